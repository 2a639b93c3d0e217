//! The threads renders run on. A chat template can build a list nested as deep as its fuel
//! allows (`{% set ns.x = [ns.x] %}` in a loop: hundreds of thousands of levels), and dropping
//! or serializing such a value recurses once per level. On the blocking pool's 2 MiB stacks
//! that overflows, and a stack overflow aborts the process. These threads have stacks deep
//! enough for anything [`super::RENDER_FUEL`] can build; the stack is reserved address space,
//! touched only as deep as a render goes. They are started as renders need them, at most
//! [`MAX_RENDER_THREADS`], so the reservation stays bounded.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::{Condvar, Mutex, OnceLock, PoisonError};

use tokio::sync::oneshot;

use super::MAX_RENDER_PERMITS;
use crate::kv::artifacts::MAX_CONCURRENT_LOADS;

/// Each render thread's stack: a 5,000,000-fuel template nesting lists as deep as it can ran
/// within 256 MiB and overflowed 64 MiB; twice that, for shapes that take more per level.
pub const RENDER_STACK_BYTES: usize = 512 << 20;
/// Render threads at most: as many as renders may run at once, and one for each artifact load
/// that may be compiling its template meanwhile (loads hold no render permit), so a request
/// holding a permit never queues behind a load.
pub const MAX_RENDER_THREADS: usize = MAX_RENDER_PERMITS + MAX_CONCURRENT_LOADS;

type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Pool {
    state: Mutex<State>,
    ready: Condvar,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    /// Threads waiting for a job.
    idle: usize,
    /// Threads started.
    threads: usize,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(Pool::default)
}

/// Runs `work` on a render thread; the receiver gets its result, or an error if it panicked or
/// no render thread could be started.
pub fn spawn<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> oneshot::Receiver<T> {
    let (tx, rx) = oneshot::channel();
    let job: Job = Box::new(move || {
        // A panic drops `tx`, which the receiver reads as a failed render.
        if let Ok(result) = std::panic::catch_unwind(AssertUnwindSafe(work)) {
            let _ = tx.send(result);
        }
    });
    let pool = pool();
    let mut state = pool.state.lock().unwrap_or_else(PoisonError::into_inner);
    state.queue.push_back(job);
    // Waiting threads count as idle until they wake: one is woken for each queued job they can
    // cover, and a job past them starts a thread of its own.
    if state.idle >= state.queue.len() {
        pool.ready.notify_one();
        return rx;
    }
    if state.threads < MAX_RENDER_THREADS {
        let started = std::thread::Builder::new()
            .name("continuum-render".into())
            .stack_size(RENDER_STACK_BYTES)
            .spawn(move || serve(pool));
        match started {
            Ok(_) => state.threads += 1,
            Err(error) if state.threads == 0 => {
                // Nothing would ever run the job: let it go, and the render falls back.
                static BUDGET: continuum_proto::log_budget::LogBudget =
                    continuum_proto::log_budget::LogBudget::per_minute(continuum_proto::log_budget::LINES_PER_MINUTE);
                if let Some(held_back) = BUDGET.admit() {
                    tracing::error!(held_back, %error, "cannot start a render thread; scoring without the KV term");
                }
                state.queue.pop_back();
            }
            Err(error) => {
                continuum_proto::warn_limited!(%error, "cannot start another render thread; the job waits for one")
            }
        }
    }
    rx
}

/// One render thread: runs queued jobs, and waits for more.
fn serve(pool: &'static Pool) {
    loop {
        let job = {
            let mut state = pool.state.lock().unwrap_or_else(PoisonError::into_inner);
            loop {
                if let Some(job) = state.queue.pop_front() {
                    break job;
                }
                state.idle += 1;
                state = pool.ready.wait(state).unwrap_or_else(PoisonError::into_inner);
                state.idle -= 1;
            }
        };
        job();
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::ChatTemplate;
    use super::*;

    #[tokio::test]
    async fn a_template_nesting_as_deep_as_its_fuel_allows_ends_in_a_refusal_not_an_abort() -> anyhow::Result<()> {
        let deepest = "{% set ns = namespace(x=none) %}{% for i in range(1000) %}{% for j in range(1000) %}\
                       {% set ns.x = [ns.x] %}{% endfor %}{% endfor %}{{ ns.x | tojson }}";
        // Compiling renders probes as deep as a request's render: both run on a render thread.
        let rendered = spawn(move || {
            let template = ChatTemplate::new(&json!({"chat_template": deepest}), None)?;
            anyhow::Ok(template.render(&json!({"messages": [{"role": "user", "content": "hi"}]})))
        });
        assert!(rendered.await??.is_err(), "out of fuel or output, and the process lives on");
        Ok(())
    }

    #[tokio::test]
    async fn a_panicking_job_reads_as_a_failed_one_and_the_threads_carry_on() {
        let panicked = spawn(|| -> u32 { panic!("a render bug") });
        assert!(panicked.await.is_err());
        assert_eq!(spawn(|| 7).await.ok(), Some(7));
    }
}
