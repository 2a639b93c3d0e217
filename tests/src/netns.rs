//! A private network namespace per test, for the real Dynamo fleet. Dynamo 1.6.1 binds its ZMQ
//! publishers on `0.0.0.0`, so every process of such a test (etcd, the workers, the control
//! plane, the replicas) and every client the test uses runs inside one, and nothing listens
//! beyond the namespace's own loopback.
//!
//! The guard owns every process it starts. Dropping it (a failed test or a panic included)
//! SIGKILLs and reaps them, kills whatever they started in turn, then deletes the namespace.
//! A namespace left by a test process that was itself killed is removed by the next guard.

use std::ffi::OsStr;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context, anyhow, bail, ensure};

/// Every namespace this guard creates is `continuum-<test pid>-<n>`.
const PREFIX: &str = "continuum-";
/// The last lines of each process log printed when the guard drops (nextest shows them only
/// for a failing test).
const LOG_TAIL_LINES: usize = 15;
/// Ends each body in curl's output, before its status: no JSON body holds a raw control
/// character.
const CURL_STATUS: &str = "\n\u{1f}";
/// Proxy settings would send clients to an address the namespace cannot reach.
const PROXY_VARS: [&str; 6] = ["http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"];

/// A network namespace with its loopback up, the processes started in it, and a temporary
/// directory for their data and logs.
#[derive(Debug)]
pub struct NetNs {
    name: String,
    dir: tempfile::TempDir,
    children: Mutex<Vec<Spawned>>,
}

#[derive(Debug)]
struct Spawned {
    label: String,
    child: Child,
}

impl NetNs {
    /// Creates `continuum-<pid>-<n>`. Fails, saying why, where `ip netns` is unavailable
    /// (not root, or no iproute2): these tests must not pass by skipping.
    pub fn create() -> anyhow::Result<Self> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        static OWN_LEFTOVERS: std::sync::Once = std::sync::Once::new();
        // Before this process names its first namespace, one under its pid can only be a
        // leftover of an earlier process that had the same pid (killed past its cleanup).
        OWN_LEFTOVERS.call_once(|| remove_stale(Some(std::process::id())));
        remove_stale(None);
        let dir = tempfile::tempdir()?;
        let name = format!("{PREFIX}{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        ip(&["netns", "add", &name]).map_err(|error| {
            anyhow!(
                "cannot create the network namespace {name}: {error:#}. The real-Dynamo tests run every process in a \
                 private namespace (Dynamo binds 0.0.0.0), so they need root and iproute2's `ip netns`: run them as \
                 root, after scripts/test has installed iproute2"
            )
        })?;
        let ns = Self { name, dir, children: Mutex::default() };
        ip(&["netns", "exec", &ns.name, "ip", "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where the processes' data and logs go; removed with the guard.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `program` run inside the namespace (`ip netns exec` execs it, so the child's pid is the
    /// program's own), without proxy settings, with its temporary files in [`Self::dir`]: Dynamo's
    /// processes each leave a logging configuration in `$TMPDIR`, which would otherwise pile up
    /// in `/tmp` run after run.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.name]).arg(program).env("TMPDIR", self.dir());
        for var in PROXY_VARS {
            command.env_remove(var);
        }
        command
    }

    /// Starts `command` (from [`Self::command`]) with its output in `<dir>/<label>.log`.
    /// Returns its pid, the handle for [`Self::terminate`] and [`Self::kill`].
    pub fn spawn(&self, label: &str, mut command: Command) -> anyhow::Result<u32> {
        let log = File::create(self.log_path(label))?;
        command.stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
        let child = command.spawn().with_context(|| format!("cannot start {label}"))?;
        Ok(self.keep(label, child))
    }

    /// Like [`Self::spawn`], but hands the process's stdout to the caller.
    pub fn spawn_reading(
        &self,
        label: &str,
        mut command: Command,
    ) -> anyhow::Result<(u32, tokio::process::ChildStdout)> {
        command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(File::create(self.log_path(label))?);
        let mut child = command.spawn().with_context(|| format!("cannot start {label}"))?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("{label} has no stdout"))?;
        let pid = self.keep(label, child);
        Ok((pid, tokio::process::ChildStdout::from_std(stdout)?))
    }

    /// Runs `command` (from [`Self::command`]) to completion; its stdout, or an error with its
    /// stderr when it fails.
    pub async fn run(&self, command: Command) -> anyhow::Result<String> {
        let output = tokio::process::Command::from(command).kill_on_drop(true).output().await?;
        ensure!(output.status.success(), "{}: {}", output.status, String::from_utf8_lossy(&output.stderr).trim());
        Ok(String::from_utf8(output.stdout)?)
    }

    /// `GET url` from inside the namespace: the status and the body.
    pub async fn get(&self, url: &str) -> anyhow::Result<(u16, String)> {
        self.get_all(&[url]).await?.pop().ok_or_else(|| anyhow!("curl answered nothing for {url}"))
    }

    /// `GET`s each of `urls` in turn with one curl inside the namespace (one process instead
    /// of one each keeps a poll short): each status and body.
    pub async fn get_all(&self, urls: &[&str]) -> anyhow::Result<Vec<(u16, String)>> {
        let mut curl = self.command("curl");
        // Generous: one poll that a loaded machine slows must not fail the test.
        curl.args(["-sS", "--max-time", "10", "--write-out", &format!("{CURL_STATUS}%{{http_code}}\n")]).args(urls);
        let out = self.run(curl).await?;
        let mut rest = out.as_str();
        let mut answers = Vec::with_capacity(urls.len());
        for url in urls {
            let (body, after) = rest.split_once(CURL_STATUS).ok_or_else(|| anyhow!("no status from curl for {url}"))?;
            let (status, next) = after.split_once('\n').ok_or_else(|| anyhow!("a cut status from curl for {url}"))?;
            answers.push((status.parse()?, body.to_string()));
            rest = next;
        }
        Ok(answers)
    }

    /// `GET url` from inside the namespace, which must answer 200 with JSON.
    pub async fn get_json(&self, url: &str) -> anyhow::Result<serde_json::Value> {
        Ok(self.get_all_json(&[url]).await?.pop().unwrap_or_default())
    }

    /// [`Self::get_all`], where every answer must be 200 with JSON.
    pub async fn get_all_json(&self, urls: &[&str]) -> anyhow::Result<Vec<serde_json::Value>> {
        let answers = self.get_all(urls).await?;
        let json = |(url, (status, body)): (&&str, (u16, String))| {
            ensure!(status == 200, "GET {url}: {status} {body}");
            Ok(serde_json::from_str(&body)?)
        };
        urls.iter().zip(answers).map(json).collect()
    }

    /// SIGTERM to a process this guard started and that has not exited.
    pub fn terminate(&self, pid: u32) -> anyhow::Result<()> {
        let mut children = self.children()?;
        let spawned = find(&mut children, pid)?;
        // Not yet reaped, so the pid cannot have been reused while the lock is held.
        ensure!(spawned.child.try_wait()?.is_none(), "{} ({pid}) has already exited", spawned.label);
        let status = Command::new("kill").args(["-TERM", &pid.to_string()]).status()?;
        ensure!(status.success(), "kill -TERM {pid}: {status}");
        Ok(())
    }

    /// SIGKILL to a process this guard started, and reap it.
    pub fn kill(&self, pid: u32) -> anyhow::Result<ExitStatus> {
        let mut children = self.children()?;
        let spawned = find(&mut children, pid)?;
        spawned.child.kill()?;
        Ok(spawned.child.wait()?)
    }

    /// The exit status of a process this guard started, once it has exited.
    pub fn exited(&self, pid: u32) -> anyhow::Result<Option<ExitStatus>> {
        let mut children = self.children()?;
        Ok(find(&mut children, pid)?.child.try_wait()?)
    }

    /// The last lines of a process's log, for error messages.
    pub fn log_tail(&self, label: &str) -> String {
        let text = std::fs::read_to_string(self.log_path(label)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
    }

    fn log_path(&self, label: &str) -> PathBuf {
        self.dir.path().join(format!("{label}.log"))
    }

    fn keep(&self, label: &str, child: Child) -> u32 {
        let pid = child.id();
        let mut children = self.children.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        children.push(Spawned { label: label.to_string(), child });
        pid
    }

    fn children(&self) -> anyhow::Result<MutexGuard<'_, Vec<Spawned>>> {
        self.children.lock().map_err(|_| anyhow!("a thread panicked while holding the process list"))
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // Writes that fail are ignored: `eprintln!` panics on a closed stderr (a benchmark piped
        // into `head`), and a panic here, often during another's unwinding, aborts before the
        // processes and the namespace are gone.
        let mut stderr = std::io::stderr();
        let children = std::mem::take(self.children.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner()));
        // Last started first: the workers go before the etcd they would otherwise retry.
        for mut spawned in children.into_iter().rev() {
            let _ = spawned.child.kill();
            let _ = spawned.child.wait();
            let tail = self.log_tail(&spawned.label);
            let _ = writeln!(stderr, "--- {} ({}) log tail ---\n{tail}", spawned.label, spawned.child.id());
        }
        kill_everything_in(&self.name);
        if let Err(error) = ip(&["netns", "delete", &self.name]) {
            let _ = writeln!(stderr, "cannot delete the network namespace {}: {error:#}", self.name);
        }
    }
}

fn find(children: &mut [Spawned], pid: u32) -> anyhow::Result<&mut Spawned> {
    children
        .iter_mut()
        .find(|s| s.child.id() == pid)
        .ok_or_else(|| anyhow!("process {pid} was not started by this namespace"))
}

fn ip(args: &[&str]) -> anyhow::Result<Output> {
    let output = Command::new("ip").args(args).output().context("cannot run `ip` (iproute2)")?;
    if !output.status.success() {
        bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&output.stderr).trim());
    }
    Ok(output)
}

/// SIGKILLs what is still inside a namespace only tests create: processes that the guard's
/// own children started in turn.
fn kill_everything_in(name: &str) {
    let Ok(output) = ip(&["netns", "pids", name]) else { return };
    for pid in String::from_utf8_lossy(&output.stdout).split_whitespace() {
        let _ = Command::new("kill").args(["-KILL", pid]).stderr(Stdio::null()).status();
    }
    std::thread::sleep(Duration::from_millis(50));
}

/// Removes `continuum-<pid>-<n>` namespaces whose test process is gone (killed before its
/// guard could drop), and those under `own` pid (this process's, before it made any), with
/// anything still running in them.
fn remove_stale(own: Option<u32>) {
    let Ok(output) = ip(&["netns", "list"]) else { return };
    for name in String::from_utf8_lossy(&output.stdout).lines().filter_map(|l| l.split_whitespace().next()) {
        let Some((pid, n)) = name.strip_prefix(PREFIX).and_then(|rest| rest.split_once('-')) else { continue };
        let (Ok(pid), Ok(_)) = (pid.parse::<u32>(), n.parse::<u32>()) else { continue };
        if own == Some(pid) || !Path::new("/proc").join(pid.to_string()).exists() {
            kill_everything_in(name);
            let _ = ip(&["netns", "delete", name]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exists(name: &str) -> anyhow::Result<bool> {
        let listed = ip(&["netns", "list"])?;
        Ok(String::from_utf8_lossy(&listed.stdout).lines().any(|l| l.split_whitespace().next() == Some(name)))
    }

    /// What a test killed past its cleanup leaves: a namespace under its pid, whether that pid
    /// is gone or (after a reboot's worth of reuse) now this very process's.
    #[test]
    fn leftovers_under_a_dead_pid_or_this_processs_own_go_before_the_first_namespace() -> anyhow::Result<()> {
        let own = format!("{PREFIX}{}-{}", std::process::id(), u32::MAX);
        // Pids stop short of 2^22 on Linux: this one never ran.
        let dead = format!("{PREFIX}{}-0", u32::MAX);
        for name in [&own, &dead] {
            ip(&["netns", "add", name])?;
        }
        let ns = NetNs::create()?;
        let gone = (!exists(&own)?, !exists(&dead)?, exists(ns.name())?);
        for name in [&own, &dead] {
            let _ = ip(&["netns", "delete", name]);
        }
        assert_eq!(gone, (true, true, true), "both leftovers removed, the new namespace made");
        Ok(())
    }
}
