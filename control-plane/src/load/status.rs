//! What each running subscription is doing, for `GET /admin/dynamo/workers` and
//! `continuum_dynamo_load_subscriptions{state, transport}`. A status counts in the gauge under
//! its current state from its first state until it is dropped with its subscription.

use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};

use prometheus::IntGaugeVec;

use crate::config::LoadTransport;
use crate::discovery::PublisherKey;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SubscriptionState {
    /// Waiting for a carrier (broker mode without a covering broker session).
    Pending,
    Connecting,
    Connected,
    /// Waiting to reconnect after a failure.
    Backoff,
}

impl SubscriptionState {
    pub const ALL: [SubscriptionState; 4] = [
        SubscriptionState::Pending,
        SubscriptionState::Connecting,
        SubscriptionState::Connected,
        SubscriptionState::Backoff,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SubscriptionState::Pending => "pending",
            SubscriptionState::Connecting => "connecting",
            SubscriptionState::Connected => "connected",
            SubscriptionState::Backoff => "backoff",
        }
    }

    fn code(self) -> u8 {
        match self {
            SubscriptionState::Pending => 1,
            SubscriptionState::Connecting => 2,
            SubscriptionState::Connected => 3,
            SubscriptionState::Backoff => 4,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.code() == code)
    }
}

pub fn transport_label(transport: LoadTransport) -> &'static str {
    match transport {
        LoadTransport::Direct => "direct",
        LoadTransport::Broker => "broker",
    }
}

#[derive(Debug)]
pub struct SubscriptionStatus {
    /// `kv_metrics` or `kv-events`.
    pub family: &'static str,
    pub publisher: PublisherKey,
    pub component: Option<String>,
    pub transport: LoadTransport,
    state: AtomicU8,
    /// The largest message buffer any session of this subscription has held.
    buffer_high_water: AtomicUsize,
    /// Sessions that reached `connected`.
    sessions: AtomicU64,
    gauge: IntGaugeVec,
}

impl SubscriptionStatus {
    pub fn new(
        family: &'static str,
        publisher: PublisherKey,
        component: Option<String>,
        transport: LoadTransport,
        gauge: IntGaugeVec,
    ) -> Self {
        Self {
            family,
            publisher,
            component,
            transport,
            state: AtomicU8::new(0),
            buffer_high_water: AtomicUsize::new(0),
            sessions: AtomicU64::new(0),
            gauge,
        }
    }

    /// Notes the session's message buffer capacity.
    pub fn note_buffer(&self, capacity: usize) {
        self.buffer_high_water.fetch_max(capacity, Ordering::Relaxed);
    }

    /// How many sessions reached `connected` (1 while the first one lasts).
    pub fn sessions(&self) -> u64 {
        self.sessions.load(Ordering::Relaxed)
    }

    /// The largest message buffer held so far (bytes).
    pub fn buffer_high_water(&self) -> usize {
        self.buffer_high_water.load(Ordering::Relaxed)
    }

    /// `None` before the subscription's task first reports.
    pub fn state(&self) -> Option<SubscriptionState> {
        SubscriptionState::from_code(self.state.load(Ordering::Relaxed))
    }

    pub fn set(&self, state: SubscriptionState) {
        let previous = self.state.swap(state.code(), Ordering::Relaxed);
        if previous == state.code() {
            return;
        }
        if state == SubscriptionState::Connected {
            self.sessions.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(previous) = SubscriptionState::from_code(previous) {
            self.series(previous).dec();
        }
        self.series(state).inc();
    }

    fn series(&self, state: SubscriptionState) -> prometheus::IntGauge {
        self.gauge.with_label_values(&[state.as_str(), transport_label(self.transport)])
    }
}

impl Drop for SubscriptionStatus {
    fn drop(&mut self) {
        if let Some(state) = self.state() {
            self.series(state).dec();
        }
    }
}
