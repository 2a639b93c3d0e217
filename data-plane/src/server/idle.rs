//! A connection waiting for its next request: counted while it waits, and called off by its
//! server when the server closes or becomes crowded.

use std::pin::Pin;

use prometheus::IntGauge;
use tokio::sync::futures::Notified;
use tokio_util::sync::CancellationToken;

use super::Slots;

/// Why the server calls off a connection's wait for its next request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum IdleCall {
    /// The server is closing: a connection waiting idle closes.
    Closing,
    /// The server became crowded: the wait goes on no longer than the crowded idle timeout
    /// ([`CROWDED_IDLE_TIMEOUT`](super::conn::CROWDED_IDLE_TIMEOUT)).
    Crowded,
}

/// A connection's watch on the server's calls to its connections waiting idle ([`IdleCall`],
/// [`Slots::idle_call`]): one registration for the connection's life, made again only after
/// a call came, where one per request would join and leave the list of waiters, under its
/// lock, each time (and waiting on the closing token and the crowding apart, twice).
pub(super) struct IdleCalls<'s> {
    slots: &'s Slots,
    closing: &'s CancellationToken,
    notified: Pin<Box<Notified<'s>>>,
    closed: bool,
}

impl<'s> IdleCalls<'s> {
    pub(super) fn new(slots: &'s Slots, closing: &'s CancellationToken) -> Self {
        let notified = Box::pin(slots.idle_call.notified());
        // After the registration: a closing from before it is seen here, one after it calls.
        Self { slots, closing, notified, closed: closing.is_cancelled() }
    }

    /// The next call that concerns a connection waiting now. A crowding that came and went
    /// while the connection was answering is no reason to hurry its next wait.
    pub(super) async fn next(&mut self) -> IdleCall {
        loop {
            if self.closed {
                return IdleCall::Closing;
            }
            self.notified.as_mut().await;
            self.notified.set(self.slots.idle_call.notified());
            self.closed = self.closing.is_cancelled();
            if !self.closed && self.slots.crowded() {
                return IdleCall::Crowded;
            }
        }
    }
}

/// A connection waiting for its next request, counted on a gauge while it waits.
pub(super) struct Waiting<'g>(&'g IntGauge);

impl<'g> Waiting<'g> {
    pub(super) fn on(gauge: &'g IntGauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}
