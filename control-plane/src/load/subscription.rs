//! One kv_metrics subscription: a task that dials its publisher, runs a bounded ZMTP session,
//! and hands each decoded sample to the load store and on to the replicas, until cancelled.
//!
//! Lifecycle: `connecting` → `connected` (the publisher's held samples are dropped, since
//! changes may have been missed while away) → on any failure `backoff` with full jitter →
//! `connecting` again. Under `transport: broker`, which this build cannot carry, it stays
//! `pending` and never dials directly.

use std::sync::Arc;
use std::time::Duration;

use continuum_proto::model::{LoadKey, LoadSample, WorkerKey};
use prometheus::IntCounterVec;
use tokio_util::sync::CancellationToken;

use super::backoff::Backoff;
use super::decode::{KV_METRICS_TOPIC, KvMetrics, decode_kv_metrics};
use super::dial::{self, DialError};
use super::events::LoadEvent;
use super::status::{SubscriptionState, SubscriptionStatus};
use super::store::SharedLoadStore;
use super::zmtp::{Dropped, Incoming, ZmtpError, ZmtpLimits, ZmtpSubscriber};
use crate::config::{Cidr, LoadTransport};
use crate::discovery::{Publisher, PublisherKey};
use crate::fleet::LoadCoalescer;

/// What every subscription shares.
#[derive(Debug)]
pub struct SubscriptionContext {
    pub store: SharedLoadStore,
    pub sink: LoadCoalescer,
    /// `continuum_dynamo_load_events_total{result}`.
    pub events: IntCounterVec,
    pub limits: ZmtpLimits,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    pub stable_session: Duration,
}

impl SubscriptionContext {
    fn count(&self, event: LoadEvent) {
        self.events.with_label_values(&[event.as_str()]).inc();
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

/// Runs the subscription until `cancel` fires.
pub async fn run(
    ctx: Arc<SubscriptionContext>,
    publisher: Publisher,
    policy: DialPolicy,
    status: Arc<SubscriptionStatus>,
    cancel: CancellationToken,
) {
    if policy.transport == LoadTransport::Broker {
        // No event-bus carrier in this build: wait, never fall back to dialling directly.
        status.set(SubscriptionState::Pending);
        cancel.cancelled().await;
        return;
    }
    let mut backoff = Backoff::new(ctx.backoff_initial, ctx.backoff_max);
    loop {
        status.set(SubscriptionState::Connecting);
        let started = tokio::time::Instant::now();
        let ended = tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            ended = session(&ctx, &publisher, &policy, &status) => ended,
        };
        report(&ctx, &publisher, &ended);
        backoff.session_ended(started.elapsed(), ctx.stable_session);
        status.set(SubscriptionState::Backoff);
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
}

fn report(ctx: &SubscriptionContext, publisher: &Publisher, ended: &SessionEnd) {
    let id = publisher.publisher_id;
    let namespace = publisher.namespace.as_ref();
    match ended {
        SessionEnd::Zmtp(error) if error.is_violation() => {
            ctx.count(LoadEvent::TransportRefused);
            tracing::warn!(publisher_id = id, namespace, %error, "kv_metrics publisher refused; reconnecting with backoff");
        }
        SessionEnd::Dial(error @ DialError::NotAllowed(_)) => {
            ctx.count(LoadEvent::NotAllowed);
            tracing::warn!(publisher_id = id, namespace, %error, "kv_metrics publisher not dialled");
        }
        SessionEnd::Dial(error @ DialError::BadAddress) => {
            ctx.count(LoadEvent::TransportRefused);
            tracing::warn!(publisher_id = id, namespace, %error, "kv_metrics publisher not dialled");
        }
        _ => tracing::debug!(publisher_id = id, namespace, error = %ended, "kv_metrics session ended"),
    }
}

async fn session(
    ctx: &SubscriptionContext,
    publisher: &Publisher,
    policy: &DialPolicy,
    status: &SubscriptionStatus,
) -> SessionEnd {
    match connected_session(ctx, publisher, policy, status).await {
        Ok(never) => match never {},
        Err(end) => end,
    }
}

async fn connected_session(
    ctx: &SubscriptionContext,
    publisher: &Publisher,
    policy: &DialPolicy,
    status: &SubscriptionStatus,
) -> Result<std::convert::Infallible, SessionEnd> {
    let stream = dial::dial(&publisher.address, policy.allow.as_deref(), ctx.limits.connect_timeout).await?;
    let mut session = ZmtpSubscriber::handshake(stream, ctx.limits, KV_METRICS_TOPIC.as_bytes()).await?;
    status.set(SubscriptionState::Connected);
    let key = PublisherKey { namespace: publisher.namespace.clone(), publisher_id: publisher.publisher_id };
    let dropped = ctx.store.lock().drop_publisher(&key);
    ctx.sink.remove(dropped).await;
    let mut order = StreamOrder::default();
    loop {
        status.note_buffer(session.message_capacity().0);
        let decoded = match session.recv().await? {
            Incoming::Dropped(reason) => Err(dropped_event(reason)),
            Incoming::Message(message) => {
                decode_kv_metrics((0..message.len()).filter_map(|i| message.frame(i)), publisher.publisher_id)
            }
        };
        let outcome = decoded.and_then(|m| accept(ctx, publisher, &key, &mut order, m));
        match outcome {
            Ok(accepted) => {
                ctx.sink.remove(accepted.removed).await;
                if let Some((key, sample)) = accepted.sample {
                    ctx.sink.submit(key, sample).await;
                }
            }
            Err(event) => ctx.count(event),
        }
    }
}

fn dropped_event(reason: Dropped) -> LoadEvent {
    match reason {
        Dropped::Oversized => LoadEvent::Oversized,
        Dropped::TooManyFrames => LoadEvent::Malformed,
        Dropped::TopicTooLong => LoadEvent::TopicMismatch,
    }
}

/// The highest sequence seen on this connection: at or below it is a duplicate, past the next
/// one is a gap. Reset on every connection, since the stream starts wherever the publisher is.
#[derive(Debug, Default)]
struct StreamOrder {
    last: Option<u64>,
}

struct Accepted {
    /// Keys whose samples the store dropped (a gap), for the replicas.
    removed: Vec<LoadKey>,
    sample: Option<(LoadKey, LoadSample)>,
}

/// Orders, checks and stores one decoded sample; an `Err` is the label it is counted under.
fn accept(
    ctx: &SubscriptionContext,
    publisher: &Publisher,
    key: &PublisherKey,
    order: &mut StreamOrder,
    m: KvMetrics,
) -> Result<Accepted, LoadEvent> {
    if publisher.worker.as_ref().is_some_and(|w| w.instance_id != m.worker_id) {
        return Err(LoadEvent::IdentityMismatch);
    }
    let gap = match order.last {
        Some(last) if m.sequence <= last => return Err(LoadEvent::Duplicate),
        Some(last) => m.sequence > last + 1,
        None => false,
    };
    order.last = Some(m.sequence);
    let load_key = LoadKey { worker: WorkerKey::new(publisher.namespace.clone(), m.worker_id), dp_rank: m.dp_rank };
    let now = std::time::Instant::now();
    let mut store = ctx.store.lock();
    let removed = if gap {
        ctx.count(LoadEvent::SequenceGap);
        store.drop_publisher(key)
    } else {
        Vec::new()
    };
    match store.apply(load_key.clone(), key, m.sequence, m.load, now) {
        Ok(sample) => {
            ctx.count(LoadEvent::Applied);
            Ok(Accepted { removed, sample: Some((load_key, sample)) })
        }
        Err(event) => {
            ctx.count(event);
            Ok(Accepted { removed, sample: None })
        }
    }
}
