//! The client, run inside the namespace: drives a workload at its concurrency and prints one
//! JSON [`Answer`].

use super::*;
use tokio::sync::Semaphore;

/// One request's outcome.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Outcome {
    pub conversation: usize,
    pub turn: usize,
    /// When the request was sent, from the run's start.
    pub start_ms: f64,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: Option<u64>,
    pub completion_tokens: u64,
    pub decode_worker: Option<u64>,
    /// The worker that prefilled it: the decode worker on an aggregated fleet.
    pub prefill_worker: Option<u64>,
    pub error: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Answer {
    pub wall_ms: f64,
    pub results: Vec<Outcome>,
}

pub async fn run(file: &Path, bases: &str) -> anyhow::Result<()> {
    let workload: Workload = serde_json::from_slice(&std::fs::read(file)?)?;
    let bases: Arc<Vec<String>> = Arc::new(bases.split(',').map(str::to_string).collect());
    let http = reqwest::Client::builder().no_proxy().timeout(REQUEST_TIMEOUT).build()?;
    let permits = Arc::new(Semaphore::new(workload.spec.concurrency.max(1)));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for conversation in workload.conversations {
        let (http, permits, bases) = (http.clone(), Arc::clone(&permits), Arc::clone(&bases));
        let max_tokens = workload.spec.max_tokens;
        tasks.spawn(async move {
            tokio::time::sleep_until((started + Duration::from_millis(conversation.start_ms)).into()).await;
            let mut out = Vec::with_capacity(conversation.turns.len());
            for (turn, step) in conversation.turns.iter().enumerate() {
                tokio::time::sleep(Duration::from_millis(step.think_ms)).await;
                let Ok(_permit) = permits.acquire().await else { break };
                // Requests alternate between the replicas, as a load balancer in front would.
                let base = &bases[(conversation.id + turn) % bases.len()];
                let start_ms = started.elapsed().as_secs_f64() * 1000.0;
                let mut outcome = one(&http, base, &step.messages, max_tokens).await;
                (outcome.conversation, outcome.turn, outcome.start_ms) = (conversation.id, turn, start_ms);
                out.push(outcome);
            }
            out
        });
    }
    let mut results = Vec::new();
    while let Some(done) = tasks.join_next().await {
        results.extend(done?);
    }
    let answer = Answer { wall_ms: started.elapsed().as_secs_f64() * 1000.0, results };
    println!("{}", serde_json::to_string(&answer)?);
    Ok(())
}

async fn one(http: &reqwest::Client, base: &str, messages: &[Message], max_tokens: u32) -> Outcome {
    let began = Instant::now();
    let mut outcome = Outcome {
        conversation: 0,
        turn: 0,
        start_ms: 0.0,
        ttft_ms: None,
        e2e_ms: 0.0,
        prompt_tokens: 0,
        cached_tokens: None,
        completion_tokens: 0,
        decode_worker: None,
        prefill_worker: None,
        error: None,
    };
    if let Err(error) = stream(http, base, messages, max_tokens, began, &mut outcome).await {
        outcome.error = Some(format!("{error:#}"));
    }
    outcome.e2e_ms = began.elapsed().as_secs_f64() * 1000.0;
    outcome
}

async fn stream(
    http: &reqwest::Client,
    base: &str,
    messages: &[Message],
    max_tokens: u32,
    began: Instant,
    outcome: &mut Outcome,
) -> anyhow::Result<()> {
    let body = json!({
        "model": "tiny",
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
        "nvext": {"extra_fields": ["worker_id", "timing"]},
    });
    // A replica asks the frontend for its pins' echo only for a client that asks for
    // disclosure; the frontend itself ignores the header.
    let request = http.post(format!("{base}/v1/chat/completions")).header("x-backend", "bench");
    let mut response = request.json(&body).send().await?;
    let status = response.status();
    if !status.is_success() {
        bail!("{status}: {}", response.text().await.unwrap_or_default());
    }
    let mut pending: Vec<u8> = Vec::new();
    let mut done = false;
    while let Some(chunk) = response.chunk().await? {
        pending.extend_from_slice(&chunk);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let Some(data) = std::str::from_utf8(&line).ok().and_then(|l| l.trim().strip_prefix("data:")) else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let event: Value = serde_json::from_str(data).with_context(|| format!("an SSE event: {data}"))?;
            read_event(&event, began, outcome);
        }
    }
    ensure!(done, "the stream ended without data: [DONE]");
    ensure!(outcome.ttft_ms.is_some(), "no content chunk");
    Ok(())
}

fn read_event(event: &Value, began: Instant, outcome: &mut Outcome) {
    let has_content = event["choices"]
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["delta"]["content"].as_str().is_some_and(|s| !s.is_empty())));
    if has_content && outcome.ttft_ms.is_none() {
        outcome.ttft_ms = Some(began.elapsed().as_secs_f64() * 1000.0);
    }
    let pins = &event["nvext"]["worker_id"];
    if let Some(worker) = pins["decode_worker_id"].as_u64() {
        outcome.decode_worker = Some(worker);
    }
    if let Some(worker) = pins["prefill_worker_id"].as_u64() {
        outcome.prefill_worker = Some(worker);
    }
    let usage = &event["usage"];
    if usage.is_object() {
        outcome.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0);
        outcome.completion_tokens = usage["completion_tokens"].as_u64().unwrap_or(0);
        outcome.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"].as_u64().or(outcome.cached_tokens);
    }
}
