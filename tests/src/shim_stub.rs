//! A stand-in for `dynamo.frontend --router-mode direct` on a loopback port: it records every
//! request it receives (headers and body) and answers from a script, falling back to echoing
//! the pins it was given the way 1.6.1 does with `"nvext":{"extra_fields":["worker_id"]}`.
//! Answers can replay the real 1.6.1 exchanges captured in the fixtures, or stream SSE frames
//! the test sends one at a time (an explicit gate: nothing is sent until the test says so).

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::{Context, anyhow};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;

use crate::tools;

/// A loopback port where connections are refused, reserved for as long as this lives: a socket
/// bound to it that never listens. A port that was merely free a moment ago is not enough for a
/// test that expects refusals: a parallel test's listener may take it, or an outgoing connection
/// may pick it as its own ephemeral port and connect to itself (TCP simultaneous open), and the
/// "dead" replica then answers garbage (a 502, not the refusal's 503).
#[derive(Debug)]
pub struct RefusingPort {
    socket: tokio::net::TcpSocket,
    addr: SocketAddr,
}

impl RefusingPort {
    pub fn reserve() -> anyhow::Result<Self> {
        // No SO_REUSEADDR: any other bind of this port conflicts until the socket is dropped.
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
        let addr = socket.local_addr()?;
        Ok(Self { socket, addr })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Frees the port (for a server that must come back on it) and says which it was.
    pub fn release(self) -> SocketAddr {
        drop(self.socket);
        self.addr
    }
}

/// One request as the stub received it.
#[derive(Debug, Clone)]
pub struct Received {
    pub headers: HeaderMap,
    pub body: Value,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// A frame of a gated stream, or a failure that aborts the connection mid-body.
pub type Frame = Result<Bytes, String>;

#[derive(Debug)]
pub enum Reply {
    /// 200: a completion (or, for `stream: true`, two SSE chunks and `[DONE]`) echoing the pins.
    Echo,
    /// A fixed answer.
    Fixed { status: StatusCode, content_type: Option<String>, body: Bytes },
    /// 200 `text/event-stream` whose frames the test sends.
    Stream(mpsc::Receiver<Frame>),
    /// No answer at all, as for a generation longer than the router waits.
    Hang,
}

#[derive(Debug, Default)]
struct Shared {
    script: Mutex<VecDeque<Reply>>,
    received: Mutex<Vec<Received>>,
    count: watch::Sender<usize>,
    /// What `GET /live` answers: 200 while true, 503 otherwise.
    down: AtomicBool,
    /// The client ends of the connections `GET /live` came on, each with its probe count.
    probed_from: Mutex<BTreeMap<SocketAddr, usize>>,
    /// A decode worker whose pinned requests get the frontend's generic 500, as for a dead
    /// worker (0: none).
    failing_worker: AtomicU64,
    /// A decode worker whose pinned requests are never answered, as for a hung engine (0: none).
    hanging_worker: AtomicU64,
}

#[derive(Debug)]
pub struct StubShim {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl StubShim {
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_on("127.0.0.1:0").await
    }

    /// Serves on `addr` (to bring a replica back on the port it was configured with).
    pub async fn start_on(addr: &str) -> anyhow::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::default());
        let app = Router::new()
            .route("/v1/chat/completions", post(answer))
            .route("/live", get(live))
            .with_state(Arc::clone(&shared));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await;
        });
        Ok(Self { addr, shared, task })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Queues the answer to the next request not yet answered; unscripted requests get `Echo`.
    pub fn push(&self, reply: Reply) {
        self.shared.script.lock().unwrap_or_else(PoisonError::into_inner).push_back(reply);
    }

    /// Queues a gated stream and returns its gate.
    pub fn push_stream(&self) -> mpsc::Sender<Frame> {
        let (tx, rx) = mpsc::channel(16);
        self.push(Reply::Stream(rx));
        tx
    }

    pub fn received(&self) -> Vec<Received> {
        self.shared.received.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Follows the number of requests received.
    pub fn count(&self) -> watch::Receiver<usize> {
        self.shared.count.subscribe()
    }

    /// Answers every request pinned to decode worker `id` with a 500, as 1.6.1 does when the
    /// worker is gone; other requests are answered as usual.
    pub fn fail_worker(&self, id: u64) {
        self.shared.failing_worker.store(id, Ordering::Relaxed);
    }

    /// Never answers a request pinned to decode worker `id`, as a frontend whose worker hung
    /// mid-generation sends no head for a buffered request; other requests are answered as usual.
    pub fn hang_worker(&self, id: u64) {
        self.shared.hanging_worker.store(id, Ordering::Relaxed);
    }

    /// How many liveness probes came, and on how many connections.
    pub fn probes(&self) -> (usize, usize) {
        let probed_from = self.shared.probed_from.lock().unwrap_or_else(PoisonError::into_inner);
        (probed_from.values().sum(), probed_from.len())
    }

    /// Makes `GET /live` answer 503 (or 200 again), as a frontend on its way down would.
    pub fn set_live(&self, live: bool) {
        self.shared.down.store(!live, Ordering::Relaxed);
    }

    pub fn stop(self) {
        self.task.abort();
    }
}

/// The answer the real 1.6.1 frontend gave in the exchange `name` of `run` (`disagg`, `agg`).
pub fn fixture_reply(run: &str, name: &str) -> anyhow::Result<Reply> {
    let path = tools::dynamo_fixtures().join(run).join("http-exchanges.jsonl");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let exchange = text
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .find(|e| e["name"] == name)
        .ok_or_else(|| anyhow!("no exchange {name} in {}", path.display()))?;
    let response = &exchange["response"];
    let status = StatusCode::from_u16(u16::try_from(response["status"].as_u64().unwrap_or(0))?)?;
    let content_type = response["headers"]["content-type"].as_str().map(str::to_string);
    let body = Bytes::from(response["body"].as_str().unwrap_or_default().to_string());
    Ok(Reply::Fixed { status, content_type, body })
}

async fn live(State(shared): State<Arc<Shared>>, ConnectInfo(peer): ConnectInfo<SocketAddr>) -> Response {
    *shared.probed_from.lock().unwrap_or_else(PoisonError::into_inner).entry(peer).or_default() += 1;
    if shared.down.load(Ordering::Relaxed) {
        (StatusCode::SERVICE_UNAVAILABLE, "{\"status\":\"notready\"}").into_response()
    } else {
        (StatusCode::OK, "{\"status\":\"live\"}").into_response()
    }
}

async fn answer(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let pinned_to = |worker: &AtomicU64| {
        let id = worker.load(Ordering::Relaxed);
        id != 0
            && headers.get("x-dynamo-worker-instance-id").and_then(|v| v.to_str().ok()) == Some(id.to_string().as_str())
    };
    let mut hangs = pinned_to(&shared.hanging_worker);
    let reply = if pinned_to(&shared.failing_worker) {
        Reply::Fixed { status: StatusCode::INTERNAL_SERVER_ERROR, content_type: None, body: Bytes::from_static(b"{}") }
    } else {
        shared.script.lock().unwrap_or_else(PoisonError::into_inner).pop_front().unwrap_or(Reply::Echo)
    };
    let stream = body["stream"] == true;
    let echo = echo(&headers, &body);
    shared.received.lock().unwrap_or_else(PoisonError::into_inner).push(Received { headers, body });
    shared.count.send_modify(|n| *n += 1);
    hangs |= matches!(reply, Reply::Hang);
    if hangs {
        std::future::pending::<()>().await;
    }
    match reply {
        Reply::Echo if stream => sse(Body::from(echo_stream(&echo))),
        Reply::Echo => axum::Json(echo).into_response(),
        Reply::Fixed { status, content_type, body } => {
            let mut response = (status, body).into_response();
            if let Some(value) = content_type.and_then(|c| c.parse().ok()) {
                response.headers_mut().insert(header::CONTENT_TYPE, value);
            }
            response
        }
        Reply::Stream(rx) => sse(Body::from_stream(ReceiverStream::new(rx))),
        Reply::Hang => unreachable!("a hung reply never answers"),
    }
}

fn sse(body: Body) -> Response {
    ([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], body).into_response()
}

/// A completion naming the pins received, shaped like 1.6.1's `nvext.worker_id` echo. Its id
/// names the request's `user` where it has one, so a test can tell the answers apart.
fn echo(headers: &HeaderMap, body: &Value) -> Value {
    let pin = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    json!({
        "id": format!("chatcmpl-{}", body["user"].as_str().unwrap_or("stub")),
        "object": "chat.completion",
        "model": body["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "stub"}, "finish_reason": "stop"}],
        "nvext": {"worker_id": {
            "prefill_worker_id": pin("x-dynamo-prefill-instance-id"),
            "decode_worker_id": pin("x-dynamo-worker-instance-id"),
            "prefill_dp_rank": pin("x-dynamo-prefill-dp-rank"),
            "decode_dp_rank": pin("x-dynamo-dp-rank"),
        }},
    })
}

fn echo_stream(echo: &Value) -> String {
    let chunk = json!({"id": "chatcmpl-stub", "object": "chat.completion.chunk", "model": echo["model"],
        "choices": [{"index": 0, "delta": {"content": "stub"}, "finish_reason": null}], "nvext": echo["nvext"]});
    format!("data: {chunk}\n\ndata: {chunk}\n\ndata: [DONE]\n\n")
}
