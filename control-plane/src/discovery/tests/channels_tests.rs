//! Event channels: which become publishers, and how a publisher finds its worker and rank.

use serde_json::json;

use super::super::{EventKind, KeyValue, Topic, WatchEvent};
use super::{NS, Sim, channel_key, channel_value, counts, source_key, source_value, zmq};

const PUBLISHER: u64 = 0x149f52fc2aeb38;
const WORKER: u64 = 0x6a6c_a228_814c_9750;

#[test]
fn only_direct_zmq_tcp_channels_on_known_topics_become_publishers() {
    let broker =
        json!({"kind": "ZmqBroker", "config": {"xsub_endpoints": ["tcp://b:1"], "xpub_endpoints": ["tcp://b:2"]}});
    let no_id = json!({"type": "EventChannel", "topic": "kv_metrics", "transport": zmq("tcp://10.0.0.7:41000")});
    let mut unknown_scope = channel_value("kv_metrics", PUBLISHER, zmq("tcp://10.0.0.7:41000"));
    unknown_scope["scope"] = json!({"kind": "cluster"});
    let mut no_transport = channel_value("kv_metrics", PUBLISHER, json!(null));
    no_transport.as_object_mut().map(|o| o.remove("transport"));
    let tcp = zmq("tcp://10.0.0.7:41000");
    // (what, topic in the key, value, counted as, publisher address)
    let cases = [
        (
            "direct zmq kv_metrics",
            "kv_metrics",
            channel_value("kv_metrics", PUBLISHER, tcp.clone()),
            EventKind::Put,
            Some("tcp://10.0.0.7:41000"),
        ),
        (
            "direct zmq kv-events",
            "kv-events",
            channel_value("kv-events", PUBLISHER, tcp.clone()),
            EventKind::Put,
            Some("tcp://10.0.0.7:41000"),
        ),
        ("zmq broker", "kv_metrics", channel_value("kv_metrics", PUBLISHER, broker), EventKind::Unsupported, None),
        (
            "nats",
            "kv_metrics",
            channel_value("kv_metrics", PUBLISHER, json!({"kind": "Nats", "config": {"subject_prefix": "x"}})),
            EventKind::Unsupported,
            None,
        ),
        (
            "unknown transport",
            "kv_metrics",
            channel_value("kv_metrics", PUBLISHER, json!({"kind": "Quic", "config": {}})),
            EventKind::Unsupported,
            None,
        ),
        (
            "an endpoint longer than any host and port",
            "kv_metrics",
            channel_value("kv_metrics", PUBLISHER, zmq(&format!("tcp://{}:1", "a".repeat(60_000)))),
            EventKind::Unsupported,
            None,
        ),
        (
            "ipc endpoint",
            "kv_metrics",
            channel_value("kv_metrics", PUBLISHER, zmq("ipc:///tmp/x")),
            EventKind::Unsupported,
            None,
        ),
        ("unknown scope kind", "kv_metrics", unknown_scope, EventKind::Unsupported, None),
        ("missing publisher id", "kv_metrics", no_id, EventKind::Malformed, None),
        ("missing transport", "kv_metrics", no_transport, EventKind::Malformed, None),
        (
            "zmq without endpoint",
            "kv_metrics",
            channel_value("kv_metrics", PUBLISHER, json!({"kind": "Zmq", "config": {}})),
            EventKind::Malformed,
            None,
        ),
        (
            "forward-pass-metrics",
            "forward-pass-metrics",
            channel_value("forward-pass-metrics", PUBLISHER, tcp.clone()),
            EventKind::Skipped,
            None,
        ),
        (
            "active_sequences_events",
            "active_sequences_events",
            channel_value("active_sequences_events", PUBLISHER, tcp),
            EventKind::Skipped,
            None,
        ),
    ];
    for (what, topic, value, kind, address) in cases {
        let mut sim = Sim::new();
        let applied = sim.put(channel_key(NS, "backend", topic, PUBLISHER), &value);
        assert_eq!(counts(&applied), vec![(kind, 1)], "{what}");
        assert_eq!(sim.publisher(PUBLISHER).map(|p| p.address), address.map(str::to_owned), "{what}");
    }
}

#[test]
fn publishers_find_their_worker_by_lease_or_event_source() {
    let channel = |topic: &str| channel_value(topic, PUBLISHER, zmq("tcp://10.0.0.7:41000"));
    let leased = |topic: &str| {
        WatchEvent::Put(
            KeyValue::new(channel_key(NS, "backend", topic, PUBLISHER), channel(topic).to_string()).with_lease(WORKER),
        )
    };
    let bare = |topic: &str| WatchEvent::Put(super::kv(channel_key(NS, "backend", topic, PUBLISHER), &channel(topic)));
    let source = |rank: u32| {
        WatchEvent::Put(super::kv(
            source_key(NS, "backend", "kv-events", PUBLISHER),
            &source_value(PUBLISHER, WORKER + 1, rank),
        ))
    };
    // (what, events, topic, worker, dp rank)
    let cases = [
        ("lease alone", vec![leased("kv_metrics")], Topic::KvMetrics, Some(WORKER), None),
        ("no lease, no source", vec![bare("kv-events")], Topic::KvEvents, None, None),
        (
            "source gives worker and rank",
            vec![bare("kv-events"), source(1)],
            Topic::KvEvents,
            Some(WORKER + 1),
            Some(1),
        ),
        (
            "lease wins over the source's worker",
            vec![source(0), leased("kv-events")],
            Topic::KvEvents,
            Some(WORKER),
            Some(0),
        ),
        (
            "a kv-events source does not rank a kv_metrics channel",
            vec![leased("kv_metrics"), source(1)],
            Topic::KvMetrics,
            Some(WORKER),
            None,
        ),
    ];
    for (what, events, topic, worker, dp_rank) in cases {
        let mut sim = Sim::new();
        for event in events {
            sim.apply(event);
        }
        let publisher = sim.publisher(PUBLISHER);
        let got = publisher.map(|p| (p.topic, p.worker.map(|w| w.instance_id), p.dp_rank, p.component));
        assert_eq!(got, Some((topic, worker, dp_rank, Some("backend".into()))), "{what}");
    }
}

#[test]
fn deleting_the_event_source_drops_only_the_rank() {
    let mut sim = Sim::new();
    sim.put(
        channel_key(NS, "backend", "kv-events", PUBLISHER),
        &channel_value("kv-events", PUBLISHER, zmq("tcp://h:1")),
    );
    sim.put(source_key(NS, "backend", "kv-events", PUBLISHER), &source_value(PUBLISHER, WORKER, 1));
    sim.delete(source_key(NS, "backend", "kv-events", PUBLISHER));
    assert_eq!(sim.publisher(PUBLISHER).map(|p| (p.dp_rank, p.worker)), Some((None, None)));
}

#[test]
fn namespace_and_component_scoped_channel_keys_are_accepted() {
    let value = channel_value("kv_metrics", PUBLISHER, zmq("tcp://h:1"));
    let keys = [
        (format!("v1/event_channels/namespace/{NS}/topic/kv_metrics/{PUBLISHER:x}"), None, None),
        (
            format!("v1/event_channels/namespace/{NS}/component/decode/topic/kv_metrics/{PUBLISHER:x}"),
            Some("decode"),
            None,
        ),
    ];
    for (key, component, endpoint) in keys {
        let mut sim = Sim::new();
        sim.put(&key, &value);
        let scope = sim.publisher(PUBLISHER).map(|p| (p.component, p.endpoint));
        assert_eq!(scope, Some((component.map(str::to_owned), endpoint)), "{key}");
    }
}

#[test]
fn an_unsupported_channel_replacing_a_supported_one_removes_the_publisher() {
    let mut sim = Sim::new();
    let key = channel_key(NS, "backend", "kv_metrics", PUBLISHER);
    sim.put(&key, &channel_value("kv_metrics", PUBLISHER, zmq("tcp://h:1")));
    let applied = sim.put(&key, &channel_value("kv_metrics", PUBLISHER, json!({"kind": "Nats", "config": {}})));
    assert_eq!((counts(&applied), applied.fleet_changed()), (vec![(EventKind::Unsupported, 1)], true));
    assert!(sim.fleet().publishers.is_empty());
}
