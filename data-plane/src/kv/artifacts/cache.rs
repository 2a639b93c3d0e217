//! The content-addressed artifact cache: `<cache_dir>/blobs/<64 hex>`, owner-only (directories
//! 0700, files 0600). A blob is re-hashed on every read and evicted when it no longer matches
//! its name, so a file modified on disk is never loaded. Blocking I/O: call it from the blocking
//! pool.

use std::collections::{BTreeSet, HashSet};
use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use super::card::Checksum;

/// The largest artifact the router reads, fetches or caches.
pub const MAX_ARTIFACT_BYTES: u64 = 64 << 20;

#[derive(Debug)]
pub struct BlobCache {
    blobs: PathBuf,
}

/// What a cache read found.
#[derive(Debug)]
pub enum CacheRead {
    Hit(Vec<u8>),
    Miss,
    /// The blob did not hash to its name (or outgrew the size cap) and was removed.
    Evicted(EvictReason),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictReason {
    ChecksumMismatch,
    TooLarge,
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("larger than the {MAX_ARTIFACT_BYTES}-byte artifact cap")]
    TooLarge,
    #[error("not a regular file")]
    NotAFile,
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl BlobCache {
    /// Creates `dir/blobs` if needed (what it creates owner-only) and makes `blobs` owner-only
    /// whatever it was before. `dir` itself is the operator's and keeps its mode: it may be a
    /// shared directory (`/tmp`, a volume's mount point the replica does not own), and every
    /// blob is checked against its checksum when read anyway.
    ///
    /// In a shared `dir` another user may have made `blobs` first: a symlink would have the
    /// mode set, and the pruning done, on whatever it points at, so `blobs` must be a directory
    /// itself; and one that user owns they could still swap for a symlink later (a sticky
    /// directory lets an owner rename its own), so it must be this process's.
    pub fn open(dir: &Path) -> io::Result<Self> {
        let blobs = dir.join("blobs");
        fs::DirBuilder::new().recursive(true).mode(0o700).create(&blobs)?;
        // And `dir` must not let others rename what is in it: in a directory others may write
        // that is not sticky, anyone could move `blobs` aside and put a symlink in its place
        // after the checks below, and the writes and the pruning would follow it; and its
        // owner may rename anything in it, so that must be this process's user or root (a
        // volume's mount point).
        let us = fs::metadata("/proc/self")?.uid();
        let parent = fs::metadata(dir)?;
        if parent.uid() != 0 {
            ours(dir, parent.uid(), us)?;
        }
        let mode = parent.mode();
        if mode & 0o022 != 0 && mode & 0o1000 == 0 {
            return Err(io::Error::other(format!(
                "{} is writable by other users and not sticky (mode {:o}): they could replace `blobs` with a symlink",
                dir.display(),
                mode & 0o7777
            )));
        }
        let made = fs::symlink_metadata(&blobs)?;
        if !made.file_type().is_dir() {
            return Err(io::Error::other(format!("{} is not a directory of its own (a symlink?)", blobs.display())));
        }
        // `/proc/self` belongs to the process's effective user.
        ours(&blobs, made.uid(), us)?;
        fs::set_permissions(&blobs, fs::Permissions::from_mode(0o700))?;
        Ok(Self { blobs })
    }

    pub fn path(&self, checksum: &Checksum) -> PathBuf {
        self.blobs.join(checksum.hex())
    }

    pub fn read(&self, checksum: &Checksum) -> io::Result<CacheRead> {
        let path = self.path(checksum);
        let bytes = match read_bounded(&path) {
            Ok(bytes) => bytes,
            Err(ReadError::Io(e)) if e.kind() == io::ErrorKind::NotFound => return Ok(CacheRead::Miss),
            Err(ReadError::Io(e)) => return Err(e),
            Err(ReadError::TooLarge) => return self.evict(&path, EvictReason::TooLarge),
            // Only this process writes the blobs, as regular files: the source is read instead,
            // and its verified bytes are renamed over whatever stands there.
            Err(ReadError::NotAFile) => return Err(io::Error::other("a cached blob is not a regular file")),
        };
        if checksum.matches(&bytes) {
            Ok(CacheRead::Hit(bytes))
        } else {
            self.evict(&path, EvictReason::ChecksumMismatch)
        }
    }

    /// Stores verified bytes: written to a temporary file, then renamed into place, so a reader
    /// never sees half a blob. The temporary name is this write's alone (two loads of one
    /// checksum may write at once) and is created new: never truncating a file, nor following
    /// a link, that something else put there.
    pub fn write(&self, checksum: &Checksum, bytes: &[u8]) -> io::Result<()> {
        static WRITES: AtomicU64 = AtomicU64::new(0);
        let path = self.path(checksum);
        let write = WRITES.fetch_add(1, Ordering::Relaxed);
        let temp = self.blobs.join(format!(".{}.{}.{write}.tmp", checksum.hex(), *WRITER));
        let result = (|| {
            let mut file = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&temp)?;
            file.write_all(bytes)?;
            file.sync_all()?;
            fs::rename(&temp, &path)
        })();
        if result.is_err() {
            let _ = fs::remove_file(&temp);
            return result;
        }
        // A write follows a download, at the process's peak of memory: where a predecessor was
        // killed mid-write, and restarted too soon for the prune at open to take its file as
        // abandoned. Writes are few (one a new artifact), so each looks again.
        let _ = self.sweep(None);
        result
    }

    /// Removes the blobs of checksums `keep` does not name, and temporary files other
    /// processes left behind (a crash mid-write); returns how many went. Each model or
    /// tokenizer version would otherwise keep up to three 64 MiB blobs on disk for good.
    /// Files that are neither are left alone: the directory is ours, what else is in it is not.
    pub fn prune(&self, keep: &BTreeSet<Checksum>) -> io::Result<usize> {
        self.sweep(Some(&keep.iter().map(Checksum::hex).collect()))
    }

    /// Removes other processes' abandoned temporary files, and with `keep`, the blobs it does
    /// not name.
    fn sweep(&self, keep: Option<&HashSet<String>>) -> io::Result<usize> {
        let ours = format!(".{}.", *WRITER);
        let mut removed = 0;
        for entry in fs::read_dir(&self.blobs)? {
            let entry = entry?;
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else { continue };
            let blob = name.len() == 64
                && name.bytes().all(|b| b.is_ascii_hexdigit())
                && keep.is_some_and(|keep| !keep.contains(&name));
            // `.{hex}.{writer}.{n}.tmp`: this process's may be a write under way, and so may
            // another's (replicas sharing the volume) while it is recent.
            let left_over = name.starts_with('.')
                && name.ends_with(".tmp")
                && !name.get(65..).is_some_and(|rest| rest.starts_with(&ours))
                && entry.metadata().and_then(|m| m.modified()).is_ok_and(abandoned);
            if (blob || left_over) && fs::remove_file(entry.path()).is_ok() {
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// The mark this process's temporary files carry (see [`WRITER`]).
    #[cfg(test)]
    pub fn writer_mark() -> &'static str {
        &WRITER
    }

    fn evict(&self, path: &Path, reason: EvictReason) -> io::Result<CacheRead> {
        tracing::warn!(path = ?path.display().to_string(), ?reason, "evicting a cached KV artifact");
        match fs::remove_file(path) {
            Ok(()) => Ok(CacheRead::Evicted(reason)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(CacheRead::Evicted(reason)),
            Err(e) => Err(e),
        }
    }
}

/// This process's mark on the temporary files it writes: drawn at random, not its pid, which
/// a container's process shares with the one before it (pid 1 both), so that a file a crashed
/// predecessor left is not taken for a write under way, nor its name met again.
static WRITER: LazyLock<String> = LazyLock::new(|| format!("{:016x}", rand::random::<u64>()));

/// Another process's temporary file untouched for this long is no write under way (a blob is
/// at most 64 MiB, written at once): it was left by a crash.
const ABANDONED_AFTER: Duration = Duration::from_secs(600);

fn abandoned(modified: SystemTime) -> bool {
    SystemTime::now().duration_since(modified).is_ok_and(|age| age >= ABANDONED_AFTER)
}

/// Whether `path`, owned by user `owner`, is the process's (running as user `us`).
fn ours(path: &Path, owner: u32, us: u32) -> io::Result<()> {
    if owner == us {
        return Ok(());
    }
    Err(io::Error::other(format!(
        "{} belongs to user {owner}, not to this process's ({us}): another user made it first",
        path.display()
    )))
}

/// Reads a whole regular file, refusing it as soon as it proves larger than
/// [`MAX_ARTIFACT_BYTES`] (by its metadata, or while reading if it grows), so a huge file is
/// never buffered. Anything else a path may name (a FIFO, a device, `/dev/stdout`, a directory)
/// is refused before it is opened: reading one could wait forever. It is opened without
/// blocking too, so a path swapped for a FIFO after that look, or a file whose reads wait
/// (`/proc/kmsg`), fails at once instead of holding the thread.
pub fn read_bounded(path: &Path) -> Result<Vec<u8>, ReadError> {
    if !std::fs::metadata(path)?.is_file() {
        return Err(ReadError::NotAFile);
    }
    let file = OpenOptions::new().read(true).custom_flags(O_NONBLOCK).open(path)?;
    let metadata = file.metadata()?;
    if !metadata.is_file() {
        return Err(ReadError::NotAFile);
    }
    let declared = metadata.len();
    if declared > MAX_ARTIFACT_BYTES {
        return Err(ReadError::TooLarge);
    }
    let mut bytes = Vec::with_capacity(usize::try_from(declared).unwrap_or(0));
    file.take(MAX_ARTIFACT_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_ARTIFACT_BYTES {
        return Err(ReadError::TooLarge);
    }
    Ok(bytes)
}

/// Linux's `O_NONBLOCK`: an open or read that would wait fails instead; a regular file's
/// reads never wait, so it changes nothing for them.
const O_NONBLOCK: i32 = 0o4000;

#[cfg(test)]
mod tests {
    use super::*;

    use std::fs::File;

    /// A `blobs` another user made first in a shared directory is not taken over: its owner
    /// could swap it for a symlink after the check.
    /// A predecessor killed mid-write and restarted within minutes left a temporary file the
    /// prune at open took for a write under way: the next write, once it is old, removes it.
    /// Blobs no pin names wait for a prune: a write knows nothing of pins.
    #[test]
    fn a_write_removes_what_a_crashed_writer_left_once_it_is_old() {
        let dir = tempfile::tempdir().unwrap();
        let cache = BlobCache::open(dir.path()).unwrap();
        let hex = Checksum::of(b"left").hex();
        let (crashed, writing) = (format!(".{hex}.1.0.tmp"), format!(".{hex}.2.0.tmp"));
        let unpinned = Checksum::of(b"unpinned").hex();
        for name in [&crashed, &writing, &unpinned] {
            fs::write(dir.path().join("blobs").join(name), b"x").unwrap();
        }
        let an_hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
        let file = OpenOptions::new().write(true).open(dir.path().join("blobs").join(&crashed)).unwrap();
        file.set_modified(an_hour_ago).unwrap();
        cache.write(&Checksum::of(b"new"), b"new").unwrap();
        let present = |name: &str| dir.path().join("blobs").join(name).exists();
        assert!(!present(&crashed), "abandoned: removed");
        assert!(present(&writing) && present(&unpinned), "a write under way, and a blob, are left");
    }

    #[test]
    fn a_blobs_directory_another_user_owns_is_refused() {
        let path = Path::new("/shared/blobs");
        assert!(ours(path, 1000, 1000).is_ok());
        let refused = ours(path, 65534, 0).unwrap_err().to_string();
        assert!(refused.contains("belongs to user 65534, not to this process's (0)"), "{refused}");

        // The same through `open`, where the process may hand the directory away (root, as the
        // suite runs).
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("blobs")).unwrap();
        assert!(BlobCache::open(dir.path()).is_ok(), "this process's own");
        if fs::metadata("/proc/self").unwrap().uid() == 0 {
            std::os::unix::fs::chown(dir.path().join("blobs"), Some(65534), None).unwrap();
            assert!(BlobCache::open(dir.path()).is_err(), "another user's");
            // Nor in a directory another user owns, who could rename `blobs` and put a symlink
            // in its place later, whatever its mode.
            let theirs = tempfile::tempdir().unwrap();
            std::os::unix::fs::chown(theirs.path(), Some(65534), None).unwrap();
            let refused = BlobCache::open(theirs.path()).unwrap_err().to_string();
            assert!(refused.contains("belongs to user 65534"), "{refused}");
        } else {
            // CI runs as root: there the half above must not be skipped unseen.
            assert!(std::env::var_os("CI").is_none(), "CI must run this test as root");
        }
    }

    /// What a path names can change between the look and the open: a FIFO opened is refused
    /// at once, not waited on for a writer.
    #[test]
    fn a_fifo_opened_is_refused_without_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("tokenizer.json");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let opened = OpenOptions::new().read(true).custom_flags(O_NONBLOCK).open(&fifo).unwrap();
        assert!(!opened.metadata().unwrap().is_file(), "the check after the open refuses it");
        assert!(matches!(read_bounded(&fifo), Err(ReadError::NotAFile)));
    }

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    /// A cache directory others may write is accepted only if it is sticky, as `/tmp` is:
    /// otherwise anyone could swap `blobs` for a symlink after it is checked.
    #[test]
    fn a_cache_directory_others_may_write_must_be_sticky() {
        let root = tempfile::tempdir().unwrap();
        let shared = root.path().join("shared");
        fs::create_dir(&shared).unwrap();
        fs::set_permissions(&shared, fs::Permissions::from_mode(0o777)).unwrap();
        let refused = BlobCache::open(&shared).map(drop).unwrap_err().to_string();
        assert!(refused.contains("not sticky"), "{refused}");
        fs::set_permissions(&shared, fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(BlobCache::open(&shared).is_ok(), "sticky, as /tmp is");
    }

    /// A `blobs` made a symlink (by another user of a shared directory) is refused: its mode
    /// and its pruning would reach the directory it points at.
    #[test]
    fn a_blobs_symlink_is_refused_and_what_it_points_at_keeps_its_mode() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let root = dir.path().join("kv");
        fs::create_dir(&root).unwrap();
        fs::set_permissions(elsewhere.path(), fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), root.join("blobs")).unwrap();
        let refused = BlobCache::open(&root).map(|_| ()).unwrap_err();
        assert!(refused.to_string().contains("not a directory of its own"), "{refused}");
        assert_eq!(mode(elsewhere.path()), 0o755, "its mode untouched");
    }

    #[test]
    fn cache_is_owner_only() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("kv");
        fs::DirBuilder::new().mode(0o755).create(&root).unwrap();
        fs::DirBuilder::new().mode(0o755).create(root.join("blobs")).unwrap();
        let cache = BlobCache::open(&root).unwrap();
        assert_eq!(mode(&root), 0o755, "the operator's directory keeps its mode");
        assert_eq!(mode(&root.join("blobs")), 0o700, "the cache's own is tightened");
        let created = dir.path().join("new/kv");
        BlobCache::open(&created).unwrap();
        assert_eq!((mode(&created), mode(&created.join("blobs"))), (0o700, 0o700), "what it creates is owner-only");
        let checksum = Checksum::of(b"tokenizer");
        cache.write(&checksum, b"tokenizer").unwrap();
        assert_eq!(mode(&cache.path(&checksum)), 0o600);
        // A second write of the same blob takes a temporary name of its own and replaces it.
        cache.write(&checksum, b"tokenizer").unwrap();
        assert!(matches!(cache.read(&checksum).unwrap(), CacheRead::Hit(b) if b == b"tokenizer"));
        let left: Vec<_> = fs::read_dir(root.join("blobs")).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(left.len(), 1, "no temporary file is left behind: {left:?}");
    }

    #[test]
    fn a_tampered_blob_is_evicted_not_returned() {
        let dir = tempfile::tempdir().unwrap();
        let cache = BlobCache::open(dir.path()).unwrap();
        let checksum = Checksum::of(b"good");
        cache.write(&checksum, b"good").unwrap();
        assert!(matches!(cache.read(&checksum).unwrap(), CacheRead::Hit(b) if b == b"good"));
        fs::write(cache.path(&checksum), b"evil").unwrap();
        assert!(matches!(cache.read(&checksum).unwrap(), CacheRead::Evicted(EvictReason::ChecksumMismatch)));
        assert!(!cache.path(&checksum).exists());
        assert!(matches!(cache.read(&checksum).unwrap(), CacheRead::Miss));
    }

    #[test]
    fn what_is_not_a_regular_file_is_refused_unopened() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let fifo = dir.path().join("fifo");
        // A FIFO with no writer: opening it to read would wait forever.
        let made = std::process::Command::new("mkfifo").arg(&fifo).status()?;
        anyhow::ensure!(made.success(), "mkfifo failed");
        let linked = dir.path().join("tokenizer.json");
        std::os::unix::fs::symlink("/dev/stdout", &linked)?;
        for path in [fifo.as_path(), linked.as_path(), dir.path(), Path::new("/dev/zero")] {
            assert!(matches!(read_bounded(path), Err(ReadError::NotAFile)), "{}", path.display());
        }
        Ok(())
    }

    #[test]
    fn an_oversized_file_is_refused_before_it_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big");
        File::create(&path).unwrap().set_len(MAX_ARTIFACT_BYTES + 1).unwrap();
        assert!(matches!(read_bounded(&path), Err(ReadError::TooLarge)));
        File::create(&path).unwrap().set_len(MAX_ARTIFACT_BYTES).unwrap();
        assert_eq!(read_bounded(&path).unwrap().len() as u64, MAX_ARTIFACT_BYTES);
    }
}
