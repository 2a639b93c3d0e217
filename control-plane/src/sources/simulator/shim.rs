//! The simulated direct-mode shim: `POST /v1/chat/completions` and `GET /v1/models` shaped
//! like `dynamo.frontend --router-mode direct` 1.6.1. A pinned request takes KV blocks on its
//! prefill worker for the prefill phase and on its decode worker until its last token, so the
//! workers' kv_metrics publishers report real load changes.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use rand::Rng;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::pins::{self, Known, Pins, Refusal};
use super::workers::SimulatedWorker;

/// How long the simulated prefill phase takes.
pub const PREFILL_TIME: Duration = Duration::from_millis(20);
/// How long each simulated output token takes.
pub const TOKEN_TIME: Duration = Duration::from_millis(5);
/// Output tokens when the request names no `max_tokens`, and the most it may ask for.
pub const DEFAULT_MAX_TOKENS: u64 = 16;
pub const MAX_TOKENS_CAP: u64 = 256;

/// The fleet the shim pins into.
#[derive(Debug)]
pub struct Shim {
    pub model: String,
    pub block_size: u64,
    pub prefill: Vec<Arc<SimulatedWorker>>,
    pub decode: Vec<Arc<SimulatedWorker>>,
}

pub fn router(shim: Arc<Shim>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/live", get(|| async { axum::Json(json!({"status": "live", "message": "Service is live"})) }))
        .with_state(shim)
}

async fn models(State(shim): State<Arc<Shim>>) -> Response {
    let model =
        json!({"id": shim.model, "object": "model", "created": now_secs(), "owned_by": "nvidia", "context_window": 0});
    axum::Json(json!({"object": "list", "data": [model]})).into_response()
}

async fn chat(State(shim): State<Arc<Shim>>, headers: HeaderMap, body: Bytes) -> Response {
    let request: Value = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(error) => {
            let message = format!("Failed to deserialize the JSON body into the target type: {error}");
            return refuse(&Refusal { status: StatusCode::BAD_REQUEST, message });
        }
    };
    if request["model"].as_str() != Some(shim.model.as_str()) {
        return refuse(&Refusal { status: StatusCode::NOT_FOUND, message: "Model not found".to_owned() });
    }
    let (prefill_ids, decode_ids) = (ids(&shim.prefill), ids(&shim.decode));
    let pins = match pins::resolve(&headers, &request, Known { prefill: &prefill_ids, decode: &decode_ids }) {
        Ok(pins) => pins,
        Err(refusal) => return refuse(&refusal),
    };
    let plan = Plan::new(&shim, &request, pins);
    let prefill = shim.prefill.iter().chain(&shim.decode).find(|w| w.worker_id == pins.prefill);
    if let Some(worker) = prefill {
        let _held = Held::take(worker, plan.prompt_blocks);
        tokio::time::sleep(PREFILL_TIME).await;
    }
    let Some(decode) = shim.decode.iter().find(|w| w.worker_id == pins.decode) else {
        return refuse(&Refusal::invalid());
    };
    let held = Held::take(decode, plan.prompt_blocks + plan.tokens.div_ceil(shim.block_size));
    if request["stream"] == true {
        return stream(plan, held);
    }
    tokio::time::sleep(TOKEN_TIME * u32::try_from(plan.tokens).unwrap_or(u32::MAX)).await;
    drop(held);
    axum::Json(plan.completion()).into_response()
}

fn ids(workers: &[Arc<SimulatedWorker>]) -> Vec<u64> {
    workers.iter().map(|w| w.worker_id).collect()
}

/// KV blocks a request holds on a worker; given back when dropped, even if the client left.
struct Held {
    worker: Arc<SimulatedWorker>,
    blocks: u64,
}

impl Held {
    fn take(worker: &Arc<SimulatedWorker>, blocks: u64) -> Self {
        // Only what was taken goes back: a request past the capacity must not free blocks
        // another request still holds.
        let blocks = worker.add(blocks);
        Self { worker: Arc::clone(worker), blocks }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.worker.release(self.blocks);
    }
}

/// What one request produces.
struct Plan {
    id: String,
    model: String,
    created: u64,
    prompt_tokens: u64,
    prompt_blocks: u64,
    tokens: u64,
    echo: Option<Value>,
}

impl Plan {
    fn new(shim: &Shim, request: &Value, pins: Pins) -> Self {
        let text: usize = request["messages"]
            .as_array()
            .map_or(0, |m| m.iter().filter_map(|m| m["content"].as_str()).map(str::len).sum());
        let prompt_tokens = u64::try_from(text / 4).unwrap_or(u64::MAX).saturating_add(8);
        let asked = request["max_tokens"].as_u64().or_else(|| request["max_completion_tokens"].as_u64());
        let wants_echo =
            request["nvext"]["extra_fields"].as_array().is_some_and(|f| f.iter().any(|f| f == "worker_id"));
        Self {
            id: format!("chatcmpl-{:032x}", rand::rng().random::<u128>()),
            model: shim.model.clone(),
            created: now_secs(),
            prompt_tokens,
            prompt_blocks: prompt_tokens.div_ceil(shim.block_size),
            tokens: asked.unwrap_or(DEFAULT_MAX_TOKENS).clamp(1, MAX_TOKENS_CAP),
            echo: wants_echo.then(|| worker_id(pins)),
        }
    }

    fn completion(&self) -> Value {
        let content: Vec<String> = (0..self.tokens).map(|_| word()).collect();
        let mut body = json!({
            "id": self.id, "created": self.created, "model": self.model, "object": "chat.completion",
            "choices": [{"index": 0, "message": {"content": content.concat(), "refusal": null, "role": "assistant"},
                         "finish_reason": "length", "logprobs": null}],
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                      "total_tokens": self.prompt_tokens + self.tokens, "prompt_tokens_details": {"cached_tokens": 0}},
        });
        if let Some(echo) = &self.echo {
            body["nvext"] = json!({"worker_id": echo});
        }
        body
    }

    fn chunk(&self, index: u64) -> Value {
        let last = index + 1 == self.tokens;
        let delta =
            if index == 0 { json!({"content": word(), "role": "assistant"}) } else { json!({"content": word()}) };
        let mut chunk = json!({
            "id": self.id, "created": self.created, "model": self.model, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": if last { json!("length") } else { Value::Null }, "logprobs": null}],
        });
        if let Some(echo) = &self.echo {
            chunk["nvext"] = json!({"worker_id": echo});
        }
        chunk
    }
}

/// SSE chunks, one per token, then `data: [DONE]`; the decode blocks are held to the end.
fn stream(plan: Plan, held: Held) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(4);
    tokio::spawn(async move {
        let _held = held;
        for index in 0..plan.tokens {
            tokio::time::sleep(TOKEN_TIME).await;
            if tx.send(Ok(Bytes::from(format!("data: {}\n\n", plan.chunk(index))))).await.is_err() {
                break;
            }
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
    });
    let body = Body::from_stream(ReceiverStream::new(rx));
    ([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], body).into_response()
}

fn worker_id(pins: Pins) -> Value {
    let mut echo = json!({"prefill_worker_id": pins.prefill, "decode_worker_id": pins.decode});
    if let Some(rank) = pins.prefill_dp_rank {
        echo["prefill_dp_rank"] = json!(rank);
    }
    if let Some(rank) = pins.decode_dp_rank {
        echo["decode_dp_rank"] = json!(rank);
    }
    echo
}

fn word() -> String {
    let mut rng = rand::rng();
    let len = rng.random_range(1..=4);
    let letters: String = (0..len).map(|_| char::from(b'a' + rng.random_range(0..26u8))).collect();
    format!(" {letters}")
}

fn refuse(refusal: &Refusal) -> Response {
    let reason = refusal.status.canonical_reason().unwrap_or("Error");
    let body = json!({"message": refusal.message, "type": reason, "code": refusal.status.as_u16()});
    (refusal.status, axum::Json(body)).into_response()
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
