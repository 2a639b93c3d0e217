//! The `simulator` discovery source: an embedded simulated fleet for the demo. It binds a
//! loopback ZMTP PUB listener per simulated worker for kv_metrics, one more for kv-events per
//! prefill or aggregated worker (decode workers publish none, as in 1.6.1), and the shim's
//! listener when it starts (so a taken port fails the start), publishes the workers, their
//! cards' artifacts and their publishers through the registry like any discovered fleet (the
//! load and KV supervisors subscribe to them over real ZMTP), and serves the shim until
//! cancelled. Reloading it binds new publishers, and the shim's port anew only when its
//! address changed ([`ShimSocket`]).
//!
//! A worker can be killed through the shim (`POST /simulator/workers/{id}/kill`), to watch the
//! router meet a failure as it would on a real fleet: the worker's publishers close at once, the
//! shim refuses requests pinned to it with 1.6.1's 503, and it stays discovered until its lease
//! expires (`lease_ttl`), as a SIGKILLed Dynamo worker does. Once every decode worker is gone,
//! the model is gone: the shim answers 404 with an empty body.

mod artifacts;
mod pins;
mod prefix_cache;
mod publisher;
mod shim;
mod wire;
mod workers;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener as StdListener};
use std::pin::pin;
use std::sync::Arc;
use std::time::SystemTime;

use continuum_proto::model::{Capacity, ModelArtifacts, Role, Worker, WorkerKey};
use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;

use self::publisher::Resync;
use self::shim::Shim;
use self::wire::Message;
use self::workers::SimulatedWorker;
use super::registry::Registry;
use crate::config::SimulatorConfig;
use crate::discovery::{DiscoveredWorker, Fleet, Publisher, PublisherKey, Topic};

/// The first simulated worker's instance id; the rest follow (prefill workers first). Real
/// ids are etcd lease ids, far above 2^53 (`7668682560356783938` in the 1.6.1 captures), so
/// anything that reads one as a float breaks in the demo as it would on a real fleet.
pub const FIRST_WORKER_ID: u64 = 0x6a6c_a228_814c_9700;
/// The first kv_metrics publisher id. A real publisher incarnation's id is unrelated to its
/// worker's and below 2^53 (`8699381521900608`).
pub const FIRST_PUBLISHER_ID: u64 = 0x1e_e800_0000_0000;
/// The first kv-events publisher id (`5993272610344493` in the captures).
pub const FIRST_KV_EVENTS_PUBLISHER_ID: u64 = 0x15_4ad9_0000_0000;

/// The batch size the simulated workers' capacity declares.
pub const MAX_NUM_BATCHED_TOKENS: u64 = 8192;

#[derive(Debug, thiserror::Error)]
#[error(
    "simulated fleet: cannot listen for {what} on {addr}: {source} (is another process using the port? \
     change dynamo.discovery.simulator.shim_listen, or pass --simulator-shim-listen)"
)]
pub struct SimulatorError {
    what: &'static str,
    addr: SocketAddr,
    source: std::io::Error,
}

/// The simulated shim's listening socket, bound for the configured address and kept by the
/// discovery supervisor across restarts of the simulator on that address: the new simulator
/// listens on a copy of it instead of binding the port again, so the port is never free
/// between the two (no other process can take it, and the restart cannot fail on it), and a
/// shim configured on port 0 keeps the port it was given, which the workers' cards name.
#[derive(Debug)]
pub struct ShimSocket {
    asked: SocketAddr,
    listener: StdListener,
}

/// A bound simulated fleet, ready to run.
#[derive(Debug)]
pub struct Simulator {
    fleet: Fleet,
    /// Each worker's publishers: its id, their listeners, what they publish and how they resync.
    publishers: Vec<(u64, TcpListener, broadcast::Sender<Message>, Resync)>,
    shim_listener: TcpListener,
    shim: Arc<Shim>,
    /// The workers killed through the shim.
    kills: mpsc::Receiver<u64>,
}

impl Simulator {
    /// Binds every listener the simulated fleet needs, the shim on a copy of `kept` when it was
    /// bound for the configured address; otherwise on a new socket, which `kept` then holds if
    /// the whole fleet binds.
    pub fn bind_keeping(config: &SimulatorConfig, kept: &mut Option<ShimSocket>) -> Result<Self, SimulatorError> {
        let (shim_listener, fresh) = shim_listener(config.shim_listen, kept.as_ref())?;
        let mut shim_addr = local_addr("the simulated shim", &shim_listener, config.shim_listen)?;
        // A replica never fetches from an unspecified address: name the shim by its loopback.
        if shim_addr.ip().is_unspecified() {
            let loopback =
                if shim_addr.is_ipv4() { IpAddr::V4(Ipv4Addr::LOCALHOST) } else { IpAddr::V6(Ipv6Addr::LOCALHOST) };
            shim_addr.set_ip(loopback);
        }
        let card = Arc::new(artifacts::card(shim_addr));
        let namespace: Arc<str> = Arc::from(config.namespace.as_str());
        let (mut fleet, mut publishers) = (Fleet::default(), Vec::new());
        let (mut prefill, mut decode) = (Vec::new(), Vec::new());
        let roles = std::iter::repeat_n(Role::Prefill, count(config.prefill)).chain(std::iter::repeat_n(
            if config.prefill == 0 { Role::Aggregated } else { Role::Decode },
            count(config.decode),
        ));
        let ids = (FIRST_WORKER_ID..).zip(FIRST_PUBLISHER_ID..).zip(FIRST_KV_EVENTS_PUBLISHER_ID..);
        for (((id, metrics_id), events_id), role) in ids.zip(roles) {
            let worker = Arc::new(SimulatedWorker::new(id, (metrics_id, events_id), config.total_kv_blocks));
            let key = WorkerKey::new(namespace.clone(), id);
            fleet.workers.insert(key.clone(), discovered(config, key.clone(), role, &card));
            let mut feeds: Vec<(_, _, _, Resync)> = vec![(Topic::KvMetrics, metrics_id, worker.kv_metrics(), None)];
            // A 1.6.1 decode worker beside prefill workers registers no kv-events channel: the
            // blocks it receives are announced by the prefill worker that computed them.
            if role != Role::Decode {
                feeds.push((Topic::KvEvents, events_id, worker.kv_events(), Some(Arc::clone(&worker))));
            }
            for (topic, publisher_id, messages, resync) in feeds {
                let what = "a simulated worker's publisher";
                let loopback = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
                let listener = bind(what, loopback)?;
                let address = local_addr(what, &listener, loopback)?;
                let publisher = Publisher {
                    publisher_id,
                    namespace: namespace.clone(),
                    component: Some(component(role).to_owned()),
                    endpoint: Some("generate".to_owned()),
                    topic,
                    worker: Some(key.clone()),
                    // A kv-events publisher serves one rank, as 1.6.1's do.
                    dp_rank: (topic == Topic::KvEvents).then_some(0),
                    address: format!("tcp://{address}"),
                };
                fleet.publishers.insert(PublisherKey { namespace: namespace.clone(), publisher_id }, publisher);
                publishers.push((id, listener, messages, resync));
            }
            if role == Role::Prefill { &mut prefill } else { &mut decode }.push(worker);
        }
        let block_size = u64::from(config.block_size);
        // Each worker is killed at most once, so the queue never fills.
        let (killed, kills) = mpsc::channel(prefill.len() + decode.len() + 1);
        let lease_ttl = config.lease_ttl;
        let shim = Arc::new(Shim { model: config.model.clone(), block_size, prefill, decode, killed, lease_ttl });
        if fresh.is_some() {
            *kept = fresh;
        }
        Ok(Self { fleet, publishers, shim_listener, shim, kills })
    }

    /// Publishes the fleet and serves its publishers and shim until `cancel`; deregisters a
    /// killed worker once its lease expires.
    pub async fn run(mut self, registry: Registry, cancel: CancellationToken) {
        let shim_addr = self.shim_listener.local_addr().ok();
        let mut stops: HashMap<u64, CancellationToken> = HashMap::new();
        for (worker_id, listener, messages, resync) in self.publishers {
            let stop = stops.entry(worker_id).or_insert_with(|| cancel.child_token()).clone();
            tokio::spawn(publisher::serve(listener, messages, resync, stop));
        }
        registry.publish(self.fleet.clone());
        tracing::info!(shim = ?shim_addr, "simulated fleet running");
        let shim = self.shim;
        let mut serve = pin!(
            axum::serve(self.shim_listener, shim::router(Arc::clone(&shim)))
                .with_graceful_shutdown(cancel.clone().cancelled_owned())
                .into_future()
        );
        let (lease_expired, mut expiries) = mpsc::channel(stops.len() + 1);
        loop {
            tokio::select! {
                served = &mut serve => {
                    if let Err(error) = served {
                        tracing::error!(%error, "the simulated shim stopped");
                    }
                    return;
                }
                Some(worker_id) = self.kills.recv() => {
                    // Its publishers' connections close, as a killed process's sockets do.
                    stops.get(&worker_id).inspect(|stop| stop.cancel());
                    tracing::info!(worker_id, lease_ttl = ?shim.lease_ttl, "simulated worker killed; deregistered when its lease expires");
                    let (expired, ttl, cancel) = (lease_expired.clone(), shim.lease_ttl, cancel.clone());
                    tokio::spawn(async move {
                        tokio::select! {
                            () = cancel.cancelled() => {}
                            () = tokio::time::sleep(ttl) => { let _ = expired.send(worker_id).await; }
                        }
                    });
                }
                Some(worker_id) = expiries.recv() => {
                    shim.workers().filter(|w| w.worker_id == worker_id).for_each(|w| w.expire());
                    self.fleet.workers.retain(|key, _| key.instance_id != worker_id);
                    self.fleet.publishers.retain(|_, p| p.worker.as_ref().is_none_or(|key| key.instance_id != worker_id));
                    registry.publish(self.fleet.clone());
                    tracing::info!(worker_id, "simulated worker's lease expired; deregistered");
                }
            }
        }
    }
}

fn count(n: u32) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

fn local_addr(what: &'static str, listener: &TcpListener, asked: SocketAddr) -> Result<SocketAddr, SimulatorError> {
    listener.local_addr().map_err(|source| SimulatorError { what, addr: asked, source })
}

/// The shim's listener for `asked`: a copy of `kept` when it was bound for that address, or a
/// new socket, returned with a copy to keep.
fn shim_listener(
    asked: SocketAddr,
    kept: Option<&ShimSocket>,
) -> Result<(TcpListener, Option<ShimSocket>), SimulatorError> {
    let what = "the simulated shim";
    let error = |source| SimulatorError { what, addr: asked, source };
    let (listener, fresh) = match kept.filter(|kept| kept.asked == asked) {
        Some(kept) => (kept.listener.try_clone().map_err(error)?, None),
        None => {
            let listener = bind_std(what, asked)?;
            let fresh = ShimSocket { asked, listener: listener.try_clone().map_err(error)? };
            (listener, Some(fresh))
        }
    };
    Ok((TcpListener::from_std(listener).map_err(error)?, fresh))
}

fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, SimulatorError> {
    TcpListener::from_std(bind_std(what, addr)?).map_err(|source| SimulatorError { what, addr, source })
}

/// A non-blocking listener on `addr`, for a runtime to take.
fn bind_std(what: &'static str, addr: SocketAddr) -> Result<StdListener, SimulatorError> {
    let error = |source| SimulatorError { what, addr, source };
    let listener = StdListener::bind(addr).map_err(error)?;
    listener.set_nonblocking(true).map_err(error)?;
    Ok(listener)
}

fn discovered(config: &SimulatorConfig, key: WorkerKey, role: Role, card: &Arc<ModelArtifacts>) -> DiscoveredWorker {
    let now = SystemTime::now();
    let worker = Worker {
        key,
        role,
        model: config.model.clone(),
        component: component(role).to_owned(),
        endpoint: "generate".to_owned(),
        block_size: Some(config.block_size),
        capacity: Capacity {
            total_kv_blocks: Some(config.total_kv_blocks),
            max_num_batched_tokens: Some(MAX_NUM_BATCHED_TOKENS),
            ..Capacity::default()
        },
        // Every 1.6.1 card declares data_parallel_size 1, so the replicas pin rank 0.
        dp_start_rank: 0,
        dp_size: 1,
        disaggregated_endpoint: None,
        artifacts: Some(Arc::clone(card)),
    };
    DiscoveredWorker { worker, first_seen: now, last_updated: now, card: None, excluded: None }
}

fn component(role: Role) -> &'static str {
    if role == Role::Prefill { "prefill" } else { "backend" }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A simulator and its shim on loopback ports.
    async fn serve() -> (Simulator, std::net::SocketAddr) {
        let config =
            SimulatorConfig { shim_listen: "127.0.0.1:0".parse().expect("an address"), ..SimulatorConfig::default() };
        let simulator = Simulator::bind_keeping(&config, &mut None).expect("binds");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let addr = listener.local_addr().expect("bound");
        tokio::spawn(axum::serve(listener, shim::router(Arc::clone(&simulator.shim))).into_future());
        (simulator, addr)
    }

    /// The status of a chat completion posted with `pins` (header lines).
    async fn post(addr: std::net::SocketAddr, pins: &str, body: &serde_json::Value) -> String {
        let body = serde_json::to_vec(body).expect("serializes");
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{pins}content-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connects");
        stream.write_all(head.as_bytes()).await.expect("writes");
        stream.write_all(&body).await.expect("writes");
        let mut status = [0u8; 12];
        stream.read_exact(&mut status).await.expect("answered");
        String::from_utf8_lossy(&status[9..12]).to_string()
    }

    /// A prompt of several MiB, as the replica passes on (up to 8 MiB and its token ids), is read
    /// and answered, not refused by the web framework's 2 MiB default.
    #[tokio::test]
    async fn the_shim_reads_a_body_as_large_as_a_replica_sends() {
        let (simulator, addr) = serve().await;
        let pins = format!(
            "x-dynamo-prefill-instance-id: {}\r\nx-dynamo-worker-instance-id: {}\r\n",
            simulator.shim.prefill[0].worker_id, simulator.shim.decode[0].worker_id
        );
        let content = "word ".repeat(1 << 20);
        let body =
            serde_json::json!({"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": content}]});
        assert_eq!(post(addr, &pins, &body).await, "200", "a 5 MiB body");
        // Token ids are read as such, not as a JSON tree: a million of them is answered, and
        // one that is not a token id is refused as the body's error.
        let tokens: Vec<u32> = (0..1 << 20).collect();
        let body = serde_json::json!({"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                                      "nvext": {"token_data": tokens}});
        assert_eq!(post(addr, &pins, &body).await, "200", "a million token ids");
        let body = serde_json::json!({"model": "tiny", "messages": [], "nvext": {"token_data": [-1]}});
        assert_eq!(post(addr, "", &body).await, "400");
    }

    /// As 1.6.1 does, a request whose decode pin is missing or unknown is refused only after
    /// its prefill ran: the prefill worker holds its prompt afterwards. A missing prefill pin
    /// is refused before any worker runs.
    #[tokio::test]
    async fn the_decode_pin_is_refused_after_the_prefill_ran() {
        let (simulator, addr) = serve().await;
        let block_size = usize::try_from(simulator.shim.block_size).expect("fits");
        let tokens: Vec<u32> = (0..u32::try_from(2 * block_size).expect("fits")).collect();
        let body = serde_json::json!({"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                                      "nvext": {"token_data": tokens}});
        let prompt = prefix_cache::blocks(&tokens, block_size);
        let prefill = Arc::clone(&simulator.shim.prefill[0]);
        let pin = format!("x-dynamo-prefill-instance-id: {}\r\n", prefill.worker_id);

        let decode = format!("x-dynamo-worker-instance-id: {}\r\n", simulator.shim.decode[0].worker_id);
        assert_eq!(post(addr, &decode, &body).await, "500", "no prefill pin");
        assert_eq!(prefill.held(&prompt), 0, "refused before any worker ran");

        assert_eq!(post(addr, &pin, &body).await, "400", "no decode pin");
        assert_eq!(prefill.held(&prompt), 2, "the prefill ran first");
        prefill.clear_kv();
        assert_eq!(post(addr, &format!("{pin}x-dynamo-worker-instance-id: 12345\r\n"), &body).await, "400");
        assert_eq!(prefill.held(&prompt), 2, "the prefill ran before the unknown decode pin was refused");
    }

    #[tokio::test]
    async fn cards_name_a_shim_on_every_interface_by_its_loopback_and_workers_publish_as_1_6_1s_do() {
        let config =
            SimulatorConfig { shim_listen: "0.0.0.0:0".parse().expect("an address"), ..SimulatorConfig::default() };
        let simulator = Simulator::bind_keeping(&config, &mut None).expect("binds");
        let port = simulator.shim_listener.local_addr().expect("bound").port();
        for worker in simulator.fleet.workers.iter() {
            let card = worker.worker.artifacts.as_deref().expect("a card");
            let uri = card.tokenizer.as_ref().map(|f| f.uri.as_str());
            assert_eq!(uri, Some(format!("http://127.0.0.1:{port}/artifacts/tokenizer.json").as_str()));
            let topics: Vec<Topic> = simulator
                .fleet
                .publishers
                .iter()
                .filter(|p| p.worker.as_ref() == Some(&worker.worker.key))
                .map(|p| p.topic)
                .collect();
            // As in the disaggregated capture: every worker publishes its load, and only the
            // prefill workers their KV cache.
            let expected: &[Topic] = match worker.worker.role {
                Role::Decode => &[Topic::KvMetrics],
                _ => &[Topic::KvMetrics, Topic::KvEvents],
            };
            assert_eq!(topics.len(), expected.len(), "{:?}: {topics:?}", worker.worker.role);
            assert!(expected.iter().all(|t| topics.contains(t)), "{topics:?}");
        }
    }
}
