//! What a test's code logs, captured: for the warnings that must come once, not once a message.

use std::io::Write;
use std::sync::{Arc, Mutex, PoisonError};

/// A log writer keeping what it is given.
#[derive(Clone, Default)]
struct Written(Arc<Mutex<Vec<u8>>>);

impl Write for Written {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl tracing_subscriber::fmt::MakeWriter<'_> for Written {
    type Writer = Written;

    fn make_writer(&self) -> Written {
        self.clone()
    }
}

/// Runs `f` with a subscriber of its own (this thread's), and returns what it returned and the
/// text it logged.
pub fn captured<R>(f: impl FnOnce() -> R) -> (R, String) {
    let written = Written::default();
    let subscriber = tracing_subscriber::fmt().with_ansi(false).with_writer(written.clone()).finish();
    let result = tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8_lossy(&written.0.lock().unwrap_or_else(PoisonError::into_inner)).into_owned();
    (result, text)
}

/// The warnings in `text`.
pub fn warnings(text: &str) -> usize {
    text.lines().filter(|line| line.contains(" WARN ")).count()
}
