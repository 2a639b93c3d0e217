//! One publisher subscription: a task that dials its publisher, runs a bounded ZMTP session,
//! and hands each message to its [`Feed`] (kv_metrics → the load store, kv-events → the KV
//! index), until cancelled.
//!
//! Lifecycle: `connecting` → `connected` (the feed is told, and does what its family needs of
//! a publisher that may have spoken while away: the load feed forgets its samples, the kv feed
//! keeps its blocks and lets the event ids that follow tell whether any were missed) → on any
//! failure `backoff`, a delay drawn between the floor and a ceiling that doubles per failure →
//! `connecting` again. Under `transport: broker`, which this build cannot carry, it stays
//! `pending` and never dials directly.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec};
use tokio_util::sync::CancellationToken;

use super::backoff::Backoff;
use super::dial::{self, DialError};
use super::status::{SubscriptionState, SubscriptionStatus};
use super::zmtp::{Incoming, Message, ZmtpError, ZmtpLimits, ZmtpSubscriber};
use crate::config::{Cidr, LoadTransport};
use crate::discovery::{Publisher, Topic};
use crate::sources::Generation;

pub use super::zmtp::Dropped;

/// Why a session was refused by us or broke a bound, for the feed to count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The publisher broke ZMTP or a transport bound, or announced an unusable address.
    Transport,
    /// The publisher's address resolves only outside the direct-dial allow-list.
    NotAllowed,
}

/// What subscriptions of one topic do with their publishers' streams.
pub trait Feed: Send + Sync + 'static {
    /// Per-session state (message order), reset on every connection.
    type Session: Default + Send;

    /// The discovery topic this feed subscribes to; its name is the ZMTP subscription prefix.
    fn topic(&self) -> Topic;
    /// `continuum_dynamo_{load,kv}_subscriptions{state, transport}`.
    fn gauge(&self) -> &IntGaugeVec;
    /// `continuum_dynamo_subscriptions_left_out{topic}` for this feed's topic.
    fn left_out(&self) -> &IntGauge;
    /// `continuum_dynamo_subscription_sessions_ended_total{topic, reason}` for this feed's topic.
    fn session_ends(&self) -> &SessionEnds;
    /// A session connected: what the publisher said before may be missing changes.
    fn connected(&self, publisher: &Publisher) -> impl Future<Output = ()> + Send;
    /// One received message, or one the transport dropped unread.
    fn message(
        &self,
        publisher: &Publisher,
        session: &mut Self::Session,
        message: Result<Message<'_>, Dropped>,
    ) -> impl Future<Output = ()> + Send;
    /// The session ended (or, under `transport: broker`, never started). What the publisher
    /// said is kept: a reconnect or a staleness rule decides its fate.
    fn disconnected(&self, _publisher: &Publisher) {}
    /// A session was refused; counted under the feed's own labels.
    fn refused(&self, refusal: Refusal);
    /// The publisher's subscription stopped for good (departed, replaced or restarted).
    fn departed(&self, publisher: &Publisher) -> impl Future<Output = ()> + Send;
    /// A new registry generation: only its workers and ranks may be held.
    fn set_live(&self, generation: &Generation) -> impl Future<Output = ()> + Send;
}

/// What every subscription of one feed shares.
#[derive(Debug)]
pub struct SubscriptionContext<F> {
    pub feed: F,
    pub limits: ZmtpLimits,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    pub stable_session: Duration,
}

/// How a session ended, as counted: whether the publisher was never reached, was lost after
/// its handshake, or was refused by either side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndReason {
    /// Resolving or connecting failed (nothing listening, a reset, no answer in time), or the
    /// connection closed before its handshake completed: the usual sign of a worker gone or
    /// an address unreachable.
    DialFailed,
    /// The connection closed or broke after the handshake.
    Lost,
    /// The publisher broke ZMTP or a bound (a handshake not whole within its deadline among
    /// them), or announced an address that is no address.
    Refused,
    /// The publisher's address resolves only outside `dynamo.load.direct_allow_cidrs`.
    NotAllowed,
}

impl EndReason {
    pub const ALL: [EndReason; 4] = [EndReason::DialFailed, EndReason::Lost, EndReason::Refused, EndReason::NotAllowed];

    pub fn as_str(self) -> &'static str {
        match self {
            EndReason::DialFailed => "dial_failed",
            EndReason::Lost => "lost",
            EndReason::Refused => "refused",
            EndReason::NotAllowed => "not_allowed",
        }
    }

    fn of(ended: &SessionEnd, handshaken: bool) -> Self {
        match ended {
            SessionEnd::Dial(DialError::NotAllowed(_)) => EndReason::NotAllowed,
            SessionEnd::Dial(DialError::BadAddress | DialError::Unroutable(_)) => EndReason::Refused,
            SessionEnd::Dial(_) => EndReason::DialFailed,
            SessionEnd::Zmtp(error) if error.is_violation() => EndReason::Refused,
            SessionEnd::Zmtp(_) if handshaken => EndReason::Lost,
            SessionEnd::Zmtp(_) => EndReason::DialFailed,
        }
    }
}

/// One topic's series of `continuum_dynamo_subscription_sessions_ended_total`, one per reason.
#[derive(Clone, Debug)]
pub struct SessionEnds([IntCounter; EndReason::ALL.len()]);

impl SessionEnds {
    pub fn new(counters: &IntCounterVec, topic: Topic) -> Self {
        Self(EndReason::ALL.map(|reason| counters.with_label_values(&[topic.as_str(), reason.as_str()])))
    }

    /// Series registered nowhere, for a test's feed.
    #[cfg(test)]
    pub fn unregistered(topic: Topic) -> Self {
        let counters = IntCounterVec::new(prometheus::Opts::new("ended", "test"), &["topic", "reason"]);
        Self::new(&counters.expect("valid series"), topic)
    }

    fn count(&self, reason: EndReason) {
        self.0[reason as usize].inc();
    }
}

/// How subscriptions reach their publishers; a change restarts them all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DialPolicy {
    pub transport: LoadTransport,
    pub allow: Option<Arc<[Cidr]>>,
}

/// Why a session ended.
#[derive(Debug, thiserror::Error)]
enum SessionEnd {
    #[error(transparent)]
    Dial(#[from] DialError),
    #[error(transparent)]
    Zmtp(#[from] ZmtpError),
}

/// Runs the subscription until `cancel` fires, dialling first after `first_wait` (a restart's
/// backoff, see the supervisor).
pub async fn run<F: Feed>(
    ctx: Arc<SubscriptionContext<F>>,
    publisher: Publisher,
    policy: DialPolicy,
    status: Arc<SubscriptionStatus>,
    (first_wait, cancel): (Duration, CancellationToken),
) {
    if policy.transport == LoadTransport::Broker {
        // No event-bus carrier in this build: wait, never fall back to dialling directly.
        status.set(SubscriptionState::Pending);
        ctx.feed.disconnected(&publisher);
        cancel.cancelled().await;
        return;
    }
    let mut backoff = Backoff::new(ctx.backoff_initial, ctx.backoff_max);
    let mut warned = None;
    if !first_wait.is_zero() {
        status.set(SubscriptionState::Backoff);
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(first_wait) => {}
        }
    }
    loop {
        status.set(SubscriptionState::Connecting);
        // A session's length runs from its handshake: a dial or a greeting that took long and
        // then failed is not a stable session, and must not reset the backoff.
        let mut connected_at = None;
        let ended = tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            ended = session(&ctx, &publisher, &policy, &status, &mut connected_at) => ended,
        };
        ctx.feed.disconnected(&publisher);
        ctx.feed.session_ends().count(EndReason::of(&ended, connected_at.is_some()));
        if let Some(refusal) = report(ctx.feed.topic(), &publisher, &ended, &mut warned) {
            ctx.feed.refused(refusal);
        }
        // One the publisher ended by breaking the protocol or a bound is no stable session,
        // however long it lasted: one that broke a bound every half minute would otherwise be
        // dialled again within a second each time.
        let violated = matches!(&ended, SessionEnd::Zmtp(error) if error.is_violation());
        let lasted = match connected_at {
            Some(at) if !violated => at.elapsed(),
            _ => Duration::ZERO,
        };
        backoff.session_ended(lasted, ctx.stable_session);
        status.set(SubscriptionState::Backoff);
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
}

/// Logs how a session ended; a refusal, returned to be counted, is warned of once while the
/// same refusal repeats: one that cannot change (an address that is no address, or outside
/// `direct_allow_cidrs`) would otherwise warn at every backoff, for every such publisher.
/// `warned` is the refusal last warned of; any other end of a session clears it.
fn report(
    topic: Topic,
    publisher: &Publisher,
    ended: &SessionEnd,
    warned: &mut Option<&'static str>,
) -> Option<Refusal> {
    let (id, namespace, topic) = (publisher.publisher_id, publisher.namespace.as_ref(), topic.as_str());
    let (refusal, what) = match ended {
        SessionEnd::Zmtp(error) if error.is_violation() => {
            (Refusal::Transport, "publisher refused; reconnecting with backoff")
        }
        SessionEnd::Dial(DialError::NotAllowed(_)) => (Refusal::NotAllowed, "publisher not dialled: not allowed"),
        SessionEnd::Dial(DialError::BadAddress) => (Refusal::Transport, "publisher not dialled: not an address"),
        SessionEnd::Dial(DialError::Unroutable(_)) => {
            (Refusal::Transport, "publisher not dialled: its address reaches no publisher")
        }
        _ => {
            *warned = None;
            tracing::debug!(publisher_id = id, namespace, topic, error = %ended, "session ended");
            return None;
        }
    };
    if warned.replace(what) == Some(what) {
        tracing::debug!(publisher_id = id, namespace, topic, error = %ended, "{what} (again)");
    } else {
        tracing::warn!(publisher_id = id, namespace, topic, error = %ended, "{what}");
    }
    Some(refusal)
}

async fn session<F: Feed>(
    ctx: &SubscriptionContext<F>,
    publisher: &Publisher,
    policy: &DialPolicy,
    status: &SubscriptionStatus,
    connected_at: &mut Option<tokio::time::Instant>,
) -> SessionEnd {
    match connected_session(ctx, publisher, policy, status, connected_at).await {
        Ok(never) => match never {},
        Err(end) => end,
    }
}

async fn connected_session<F: Feed>(
    ctx: &SubscriptionContext<F>,
    publisher: &Publisher,
    policy: &DialPolicy,
    status: &SubscriptionStatus,
    connected_at: &mut Option<tokio::time::Instant>,
) -> Result<std::convert::Infallible, SessionEnd> {
    let stream = dial::dial(&publisher.address, policy.allow.as_deref(), ctx.limits.connect_timeout).await?;
    let topic = ctx.feed.topic().as_str();
    // A worker's channels (one per rank) share one borrower's part of the large-message budget.
    let borrower = publisher.worker.as_ref().map_or(publisher.publisher_id, |worker| worker.instance_id);
    let mut session = ZmtpSubscriber::handshake(stream, ctx.limits, topic.as_bytes(), borrower).await?;
    *connected_at = Some(tokio::time::Instant::now());
    status.set(SubscriptionState::Connected);
    ctx.feed.connected(publisher).await;
    let mut state = F::Session::default();
    loop {
        status.note_buffer(session.message_capacity().0);
        let message = match session.recv().await? {
            Incoming::Dropped(reason) => Err(reason),
            Incoming::Message(message) => Ok(message),
        };
        ctx.feed.message(publisher, &mut state, message).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_logs::{captured, warnings};

    #[test]
    fn a_session_end_is_counted_by_where_it_failed() {
        let io = || std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let cases = [
            (SessionEnd::Dial(DialError::Connect(io())), false, EndReason::DialFailed),
            (SessionEnd::Dial(DialError::Timeout(Duration::from_secs(1))), false, EndReason::DialFailed),
            (SessionEnd::Dial(DialError::Resolve(io())), false, EndReason::DialFailed),
            (SessionEnd::Dial(DialError::BadAddress), false, EndReason::Refused),
            (SessionEnd::Dial(DialError::Unroutable(Vec::new())), false, EndReason::Refused),
            (SessionEnd::Dial(DialError::NotAllowed(Vec::new())), false, EndReason::NotAllowed),
            (SessionEnd::Zmtp(ZmtpError::Closed), false, EndReason::DialFailed),
            (SessionEnd::Zmtp(ZmtpError::Io(io())), false, EndReason::DialFailed),
            (SessionEnd::Zmtp(ZmtpError::Closed), true, EndReason::Lost),
            (SessionEnd::Zmtp(ZmtpError::Io(io())), true, EndReason::Lost),
            (SessionEnd::Zmtp(ZmtpError::Protocol("bad greeting")), false, EndReason::Refused),
            (SessionEnd::Zmtp(ZmtpError::MessageTimeout(Duration::from_secs(1))), true, EndReason::Refused),
        ];
        for (ended, handshaken, want) in cases {
            assert_eq!(EndReason::of(&ended, handshaken), want, "{ended} (handshaken: {handshaken})");
        }
    }

    #[test]
    fn a_refusal_that_repeats_is_counted_each_time_and_warned_of_once() {
        let publisher = crate::discovery::test_publisher(0xaa, None);
        let refused = || SessionEnd::Dial(DialError::BadAddress);
        let lost = || SessionEnd::Zmtp(ZmtpError::Closed);
        let (counted, text): (Vec<Option<Refusal>>, String) = captured(|| {
            let mut warned = None;
            [refused(), refused(), refused(), lost(), refused()]
                .iter()
                .map(|ended| report(Topic::KvMetrics, &publisher, ended, &mut warned))
                .collect()
        });
        let t = Some(Refusal::Transport);
        assert_eq!(counted, [t, t, t, None, t], "every refusal is counted");
        assert_eq!(warnings(&text), 2, "once, and again after a session ended otherwise:\n{text}");
    }
}
