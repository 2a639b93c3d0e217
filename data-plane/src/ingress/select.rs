//! The pick phase: from a validated request to a route. The client's model maps through
//! `model_map` to the Dynamo display name for candidate matching only; the picker runs over the
//! namespaces that have a usable shim replica; a pinned route is recorded in the ledger.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use continuum_proto::model::DataPlaneConfig;
use continuum_proto::view::FleetView;

use super::kv::{RenderedWith, Term, renders_with};
use super::request::ChatRequest;
use crate::dispatch::pool::{ShimPools, ShimReplica, serving_backends, unified_backends};
use crate::dispatch::{DispatchEnd, Fallback, Pinned, Route};
use crate::http::{AppState, KvSelection};
use crate::kv::render::PERMIT_WAIT;
use crate::routing::picker::{KvTerm, PickRequest, Pin, PromptChain};

#[derive(Debug, thiserror::Error)]
pub enum SelectError {
    #[error("no fleet view from the control plane yet")]
    NoFleetView,
    #[error("no worker serves model {model:?}")]
    ModelNotFound { model: String },
    #[error("no usable shim replica for the namespaces serving {model:?}")]
    ShimUnavailable { model: String },
    #[error("no worker serving {model:?} can be picked now")]
    NoWorkers { model: String },
}

/// How a request goes out.
#[derive(Debug)]
pub struct Routed {
    pub route: Route,
    /// The rendered prompt tokens, for `nvext.token_data` when `kv.send_token_data` is on.
    pub token_data: Option<Vec<u32>>,
}

/// Chooses how `request` is sent.
pub async fn route(state: &AppState, view: &FleetView, request: &ChatRequest) -> Result<Routed, SelectError> {
    let config = view.config();
    if !config.disaggregated_serving.enabled {
        let replicas = serving_backends(config, &request.model);
        if replicas.is_empty() {
            return Err(SelectError::ModelNotFound { model: request.model.clone() });
        }
        return Ok(Routed { route: Route::Unified { replicas: replicas.into() }, token_data: None });
    }
    let display = config.model_map.get(&request.model).map_or(request.model.as_str(), String::as_str);
    let kv = config.picker.kv_enabled.then_some(&state.kv);
    let term = match kv {
        Some(kv) => {
            // A request the fleet cannot take falls through before a render and a lookup are
            // spent on it (the picker's listing of the model's workers is kept per fleet).
            let pools = state.dispatcher.pools(config);
            let usable = usable_namespaces(state, &pools, Instant::now());
            if !state.picker.serves(view, display, &usable) {
                return fall_through(config, why_not(view, display, &usable, &request.model), &request.model);
            }
            // Boxed: rendering and the lookup take milliseconds, and inline this future would
            // double the size of every request's, load-only ones too.
            Some(Box::pin(kv_term(state, kv, view, display, request)).await)
        }
        None => None,
    };
    // Rendering and the index lookup take milliseconds: the pick runs on the clock and the
    // fleet view after them, so it counts what the other replicas dispatched meanwhile (a
    // burst arriving through several replicas otherwise lands on whichever worker looked free
    // when it arrived).
    let latest = term.as_ref().and_then(|_| state.fleet.view());
    let view = latest.as_deref().unwrap_or(view);
    let config = view.config();
    // From here to the record, one pick at a time (no await until the record).
    let turn = state.ledger.pick_turn();
    let now = Instant::now();
    let pools = state.dispatcher.pools(config);
    let usable = usable_namespaces(state, &pools, now);
    let pick = |prompt_tokens| PickRequest { model: display, prompt_tokens, namespaces: Some(&*usable) };
    // The KV picker's picks count toward the model's tokens picked (what a lookup's suggestion
    // reaches past), once one is made: a request that falls through was dispatched nowhere.
    let kv_picked = kv.filter(|_| term.is_some());
    let (selection, prompt_tokens, tokens, chain) = match (kv, term) {
        (
            Some(kv),
            Some(Term::Scored {
                tokens,
                media,
                block_size,
                overlaps,
                block_hashes,
                answer,
                lookup,
                picked_before,
                artifacts,
            }),
        ) => {
            let isl_tokens = tokens.len() as u64;
            let answer = answer.picked_meanwhile(kv.routing.picked_since(display, picked_before));
            // A rendered prompt is counted as the model counts it: the load-only estimate of
            // the requests that lose their KV term learns from every one that keeps it (but a
            // prompt with media, whose items its render counts as placeholders).
            if !media {
                state.ledger.prompt_sizes().learn(display, request.prompt_estimate, isl_tokens);
            }
            let scored = KvTerm::Scored { isl_tokens, block_size, overlaps: &overlaps, answer };
            let chain = PromptChain { block_size, hashes: block_hashes, lookup };
            let tokens = Some(tokens).filter(|_| !media).map(|tokens| (tokens, artifacts));
            (kv.picker.pick(view, &pick(isl_tokens), scored, now), isl_tokens, tokens, chain)
        }
        (Some(kv), Some(Term::Unavailable(result))) => {
            let estimate = sized(state, display, request);
            (
                kv.picker.pick(view, &pick(estimate), KvTerm::Unavailable(result), now),
                estimate,
                None,
                PromptChain::default(),
            )
        }
        _ => {
            let estimate = sized(state, display, request);
            (state.picker.pick(view, &pick(estimate), now), estimate, None, PromptChain::default())
        }
    };
    let Some(selection) = selection else {
        return fall_through(config, why_not(view, display, &usable, &request.model), &request.model);
    };
    if let Some(kv) = kv_picked {
        kv.routing.picked(display, prompt_tokens);
    }
    let replicas = pools.pool(&selection.namespace);
    let mut dispatch =
        DispatchEnd::record(&state.ledger, &state.reporter, view, &selection, prompt_tokens, &chain, !request.stream);
    drop(turn);
    // Sized by the estimate, its answer's count of the prompt calibrates it; not a prompt with
    // media, which the count includes and the estimate leaves out.
    if tokens.is_none() && !request.prompt_has_media {
        dispatch.sized_by_estimate(display, request.prompt_estimate);
    }
    let on_failure = config.disaggregated_serving.fallback_to_unified;
    let fallback = Some(unified_backends(config, &request.model))
        .filter(|unified| !unified.is_empty())
        .map(|unified| Box::new(Fallback { replicas: unified.into(), body: None, on_failure }));
    // Picked on the view after the render: the tokens go only to workers whose cards name the
    // files they were rendered with (else the frontend tokenizes the prompt itself).
    let holds_files = |pin: &Pin, key: &RenderedWith| view.worker(&pin.worker).is_some_and(|w| renders_with(w, key));
    let token_data = tokens.filter(|(_, key)| {
        config.picker.send_token_data
            && holds_files(&selection.decode, key)
            && selection.prefill.as_ref().is_none_or(|prefill| holds_files(prefill, key))
    });
    let pinned = Pinned { selection, replicas, fallback, dispatch };
    Ok(Routed { route: Route::Pinned(pinned), token_data: token_data.map(|(tokens, _)| tokens) })
}

/// The KV term of `request`: its body rendered, tokenized and looked up in the control plane's
/// index. The body's JSON tree is held, under the process's tree budget, while that runs (and
/// by a render that outlives its deadline, until it ends).
async fn kv_term(state: &AppState, kv: &KvSelection, view: &FleetView, display: &str, request: &ChatRequest) -> Term {
    // Room for the tree is waited for no longer than for a render permit: renders of large
    // bodies that outlive their deadline hold theirs, and small requests must not queue
    // behind them. Such a request is picked on its estimated size instead, as one finding no
    // render permit is (counted `render_unavailable`).
    let body = async {
        // An error is not for a body the ingress accepted; scored on load alone if it happens.
        let tree = request.tree_within(PERMIT_WAIT).await.ok()?;
        let salt = request.cache_salt(&tree).map(str::to_owned);
        Some((Arc::new(tree), salt))
    };
    let contenders = prefill_contenders(state, kv, view, display);
    kv.routing.term(view, display, body, &contenders).await
}

/// The ranks that would prefill a request for `model` on `view`, named in its lookup.
fn prefill_contenders(state: &AppState, kv: &KvSelection, view: &FleetView, model: &str) -> Vec<(u64, u32)> {
    let now = Instant::now();
    let pools = state.dispatcher.pools(view.config());
    let usable = usable_namespaces(state, &pools, now);
    let request = PickRequest { model, prompt_tokens: 0, namespaces: Some(&*usable) };
    kv.picker.prefill_contenders(view, &request, now)
}

/// The request's prompt tokens by the load-only estimate, calibrated for the model.
fn sized(state: &AppState, model: &str, request: &ChatRequest) -> u64 {
    state.ledger.prompt_sizes().tokens(model, request.prompt_estimate)
}

/// Namespaces whose pool has at least one replica a request would be let through to now: all of
/// them, borrowed, while every pool has one (the usual case), else a filtered copy.
fn usable_namespaces<'p>(state: &AppState, pools: &'p ShimPools, now: Instant) -> Cow<'p, [String]> {
    let usable = |replicas: &[ShimReplica]| replicas.iter().any(|r| state.dispatcher.usable(r, now));
    if pools.iter().all(|(_, replicas)| usable(replicas)) {
        return Cow::Borrowed(pools.namespaces());
    }
    let filtered = pools.iter().filter(|(_, replicas)| usable(replicas)).map(|(namespace, _)| namespace.to_string());
    Cow::Owned(filtered.collect())
}

/// Where a request goes when the picker found nobody. The seed's picker runs only over
/// namespaces with a usable shim replica, and a model no worker serves "falls through to
/// standard disaggregated or unified routing": so with no Dynamo worker for the model, or no
/// usable shim for those that serve it, a backend serving the model unpinned takes it. Workers
/// that are all busy are not a reason to leave the fleet.
fn fall_through(config: &DataPlaneConfig, why: SelectError, model: &str) -> Result<Routed, SelectError> {
    if !matches!(why, SelectError::ModelNotFound { .. } | SelectError::ShimUnavailable { .. }) {
        return Err(why);
    }
    let unified = unified_backends(config, model);
    if unified.is_empty() {
        return Err(why);
    }
    tracing::debug!(%why, "routing unpinned to the model's unified backends");
    Ok(Routed { route: Route::Unified { replicas: unified.into() }, token_data: None })
}

/// Why the picker found nobody: the model is served nowhere, only where no shim is usable, or
/// its workers cannot take a request now. Prefill workers alone serve nothing: dynamo.frontend
/// 1.6.1 drops the model once its last decode worker goes, whatever prefill workers remain.
fn why_not(view: &FleetView, display: &str, usable: &[String], client_model: &str) -> SelectError {
    let model = client_model.to_string();
    let serving = || view.workers().values().filter(|w| w.model == display && w.role.serves_model());
    if serving().next().is_none() {
        SelectError::ModelNotFound { model }
    } else if !serving().any(|w| usable.iter().any(|n| **n == *w.key.namespace)) {
        SelectError::ShimUnavailable { model }
    } else {
        SelectError::NoWorkers { model }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use bytes::Bytes;
    use continuum_proto::model::{
        Backend, Capacity, CheckedFile, DataPlaneConfig, DisaggregatedServing, KvArtifactPolicy, Load, LoadKey,
        LoadSample, ModelArtifacts, PickerParams, Role, ShimPool, Worker, WorkerKey,
    };

    use super::*;
    use crate::routing::picker::{KvSelectionResult, PromptSizes};

    /// Why nobody was picked, by what the fleet holds: prefill workers alone serve no model (as
    /// the frontend drops it with its last decode worker), so such a model is not found and
    /// may fall through to a unified backend.
    #[test]
    fn why_not_counts_only_workers_that_serve_the_model() {
        let fleet = |roles: &[(Role, &str)]| {
            let workers = roles.iter().enumerate().map(|(i, (role, namespace))| {
                let mut worker = (**view(1, 1, "").workers().values().next().expect("a worker")).clone();
                worker.key = WorkerKey::new(*namespace, i as u64 + 1);
                worker.role = *role;
                Arc::new(worker)
            });
            FleetView::new(1, workers, [], Arc::default()).expect("view")
        };
        let usable = ["ns".to_string()];
        let why = |roles: &[(Role, &str)]| match why_not(&fleet(roles), "tiny", &usable, "tiny-chat") {
            SelectError::ModelNotFound { .. } => "model_not_found",
            SelectError::ShimUnavailable { .. } => "shim_unavailable",
            SelectError::NoWorkers { .. } => "no_workers",
            _ => "other",
        };
        assert_eq!(why(&[]), "model_not_found");
        assert_eq!(why(&[(Role::Prefill, "ns")]), "model_not_found", "prefill workers alone");
        assert_eq!(why(&[(Role::Unknown, "ns")]), "model_not_found");
        assert_eq!(why(&[(Role::Prefill, "ns"), (Role::Decode, "other")]), "shim_unavailable");
        assert_eq!(why(&[(Role::Prefill, "ns"), (Role::Decode, "ns")]), "no_workers");
        assert_eq!(why(&[(Role::Aggregated, "ns")]), "no_workers");
    }

    /// A KV-aware fleet of one aggregated worker, `id`, behind one shim.
    fn view(version: u64, id: u64, cache_dir: &str) -> FleetView {
        kv_view(version, id, None, cache_dir, Vec::new())
    }

    /// The same fleet with the worker's card naming `artifacts`, `pinned` reviewed, and the
    /// rendered prompt sent on as `nvext.token_data`.
    fn kv_view(
        version: u64,
        id: u64,
        artifacts: Option<ModelArtifacts>,
        cache_dir: &str,
        pinned: Vec<String>,
    ) -> FleetView {
        let worker = Worker {
            key: WorkerKey::new("ns", id),
            role: Role::Aggregated,
            model: "tiny".into(),
            component: "backend".into(),
            endpoint: "generate".into(),
            block_size: Some(16),
            capacity: Capacity::default(),
            dp_start_rank: 0,
            dp_size: 0,
            disaggregated_endpoint: None,
            artifacts: artifacts.map(Arc::new),
        };
        let config = DataPlaneConfig {
            backends: vec![Backend { name: "shim".into(), url: "http://127.0.0.1:9/".into(), models: Vec::new() }],
            shim_pools: vec![ShimPool { namespace: "ns".into(), backends: vec!["shim".into()] }],
            picker: PickerParams { kv_enabled: true, send_token_data: true, ..PickerParams::default() },
            disaggregated_serving: DisaggregatedServing { enabled: true, fallback_to_unified: false },
            kv_artifacts: KvArtifactPolicy { cache_dir: cache_dir.into(), pinned, ..KvArtifactPolicy::default() },
            ..DataPlaneConfig::default()
        };
        // A fresh sample: the KV formula, not a rotation, decides.
        let sample = LoadSample {
            load: Load { kv_used_blocks: Some(0), active_prefill_tokens: Some(0), ..Load::default() },
            received_at: Instant::now(),
        };
        let loads = [(LoadKey { worker: worker.key.clone(), dp_rank: 0 }, sample)];
        FleetView::new(version, [Arc::new(worker)], loads, Arc::new(config)).expect("view")
    }

    #[tokio::test]
    async fn a_kv_aware_pick_runs_on_the_view_held_after_the_kv_term_not_the_one_the_request_came_with() {
        let state = AppState::for_tests();
        let dir = tempfile::tempdir().expect("dir");
        let cache_dir = dir.path().display().to_string();
        let arrived = view(1, 7, &cache_dir);
        // While the prompt was rendered and looked up, worker 7 left and worker 8 came.
        state.fleet.store(view(2, 8, &cache_dir));
        let body = Bytes::from_static(br#"{"model":"tiny","messages":[{"role":"user","content":"hi"}]}"#);
        let request = ChatRequest::parse(body).expect("request");
        let routed = route(&state, &arrived, &request).await.expect("routed");
        let Route::Pinned(pinned) = routed.route else { panic!("disaggregated serving pins") };
        assert_eq!(pinned.selection.decode.worker.instance_id, 8);
    }

    /// One pick at a time, from its read of the ledger to the record of its choice: a pick
    /// made while another holds its turn waits for that one's record (else both would read
    /// the ledger without the other's dispatch and could land on the same worker).
    #[tokio::test]
    async fn a_pick_waits_for_the_pick_and_record_under_way() {
        let state = AppState::for_tests();
        let dir = tempfile::tempdir().expect("dir");
        let fleet = view(1, 7, &dir.path().display().to_string());
        state.fleet.store(fleet.clone());
        let body = Bytes::from_static(br#"{"model":"tiny","messages":[{"role":"user","content":"hi"}]}"#);
        let request = ChatRequest::parse(body).expect("request");
        let (ledger, released) = (Arc::clone(&state.ledger), Arc::new(AtomicBool::new(false)));
        let (taken, turn_taken) = std::sync::mpsc::channel();
        let holder = std::thread::spawn({
            let released = Arc::clone(&released);
            move || {
                let turn = ledger.pick_turn();
                let _ = taken.send(());
                std::thread::sleep(Duration::from_millis(300));
                released.store(true, Ordering::SeqCst);
                drop(turn);
            }
        });
        turn_taken.recv().expect("the other pick holds its turn");
        route(&state, &fleet, &request).await.expect("routed");
        assert!(released.load(Ordering::SeqCst), "picked only once the other pick's turn was over");
        holder.join().expect("the holder");
    }

    /// The tiny model's files as a worker's card streams them, and their checksums to pin.
    fn tinymodel_card() -> (ModelArtifacts, Vec<String>) {
        let file = |name: &str| {
            let path = crate::kv::tests::fixture(&format!("tinymodel/{name}"));
            let bytes = std::fs::read(&path).expect("the fixture");
            let checksum = crate::kv::artifacts::Checksum::of(&bytes).to_string();
            CheckedFile { uri: path.display().to_string(), checksum, size: bytes.len() as u64 }
        };
        let card = ModelArtifacts {
            tokenizer: Some(file("tokenizer.json")),
            tokenizer_config: Some(file("tokenizer_config.json")),
            chat_template: None,
            defaults: Default::default(),
        };
        let pinned = [&card.tokenizer, &card.tokenizer_config].into_iter().flatten().map(|f| f.checksum.clone());
        let pinned = pinned.collect();
        (card, pinned)
    }

    /// A KV-aware fleet of worker 7 with the tiny model's tokenizer loaded, held by `state`.
    /// The state's FindMatches client dials a port nobody listens on: every lookup fails.
    async fn tinymodel_fleet(state: &AppState, dir: &tempfile::TempDir) -> FleetView {
        let (card, pinned) = tinymodel_card();
        let fleet = kv_view(1, 7, Some(card), &dir.path().display().to_string(), pinned);
        state.fleet.store(fleet.clone());
        let kv = &state.kv;
        let loaded = || state.metrics.kv_artifacts.with_label_values(&["loaded"]).get();
        kv.routing.prewarm(&fleet);
        // Generous: the load runs on the blocking pool, which the whole suite's tests share
        // with it on two cores.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while loaded() == 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(loaded(), 1, "the pinned tokenizer loads");
        fleet
    }

    /// A model no Dynamo worker serves goes to the backends that list it before any render or
    /// lookup is spent on it.
    #[tokio::test]
    async fn a_request_the_fleet_cannot_take_falls_through_before_its_kv_term() {
        let state = AppState::for_tests();
        let dir = tempfile::tempdir().expect("dir");
        let fleet = tinymodel_fleet(&state, &dir).await;
        let mut config = (**fleet.config()).clone();
        config.backends.push(Backend {
            name: "plain".into(),
            url: "http://127.0.0.1:9/".into(),
            models: vec!["other".into()],
        });
        let fleet = FleetView::new(2, fleet.workers().values().cloned(), [], Arc::new(config)).expect("view");
        state.fleet.store(fleet.clone());
        // What a KV term's pick adds to the tokens the lookups weigh.
        let kv = &state.kv;
        let kv_terms = || kv.routing.picked_since("other", 0);
        let before = kv_terms();
        let body = Bytes::from_static(br#"{"model":"other","messages":[{"role":"user","content":"hi"}]}"#);
        let routed = route(&state, &fleet, &ChatRequest::parse(body).expect("request")).await.expect("routed");
        let Route::Unified { replicas } = routed.route else { panic!("unpinned") };
        assert_eq!(replicas.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["plain"]);
        assert_eq!(kv_terms(), before, "no KV term was looked for, nor its tokens weighed");
    }

    /// A model whose artifacts are not pinned is routed on load alone, counted for what it
    /// lacks and not as a failed render: whether a request can be rendered is settled before
    /// its body is parsed into a tree.
    #[tokio::test]
    async fn a_request_whose_artifacts_are_unpinned_is_routed_on_load_and_counted_so() {
        let state = AppState::for_tests();
        let dir = tempfile::tempdir().expect("dir");
        let (card, _) = tinymodel_card();
        let fleet = kv_view(1, 7, Some(card), &dir.path().display().to_string(), Vec::new());
        state.fleet.store(fleet.clone());
        let kv = &state.kv;
        kv.routing.open(&fleet.config().kv_artifacts).await.expect("the artifact store opens");
        let body = Bytes::from_static(br#"{"model":"tiny","messages":[{"role":"user","content":"hi"}]}"#);
        let request = ChatRequest::parse(body).expect("the ingress accepts it");
        route(&state, &fleet, &request).await.expect("routed on load alone");
        let counted = |result: &str| state.metrics.kv_selections.with_label_values(&[result]).get();
        assert_eq!((counted("artifact_unpinned"), counted("render_unavailable")), (1, 0));
        // The body's tree is asked for only once the artifacts are at hand: a body that would
        // have no room for its tree still counts as unpinned, and is never parsed.
        let asked = std::sync::atomic::AtomicBool::new(false);
        let no_room = async {
            asked.store(true, std::sync::atomic::Ordering::Relaxed);
            None
        };
        let term = kv.routing.term(&fleet, "tiny", no_room, &[]).await;
        assert!(matches!(term, Term::Unavailable(KvSelectionResult::ArtifactUnpinned)), "{term:?}");
        assert!(!asked.load(std::sync::atomic::Ordering::Relaxed), "the tree was not asked for");
    }

    #[tokio::test]
    async fn a_prompt_whose_lookup_fails_is_still_scored_on_the_formula_and_sent_with_its_tokens() {
        let state = AppState::for_tests();
        let mut reports = state.reporter.attached_receiver().expect("the reports");
        let dir = tempfile::tempdir().expect("dir");
        let fleet = tinymodel_fleet(&state, &dir).await;

        let body = Bytes::from_static(br#"{"model":"tiny","messages":[{"role":"user","content":"hello there"}]}"#);
        let request = ChatRequest::parse(body).expect("request");
        let routed = route(&state, &fleet, &request).await.expect("routed");
        let tokens = routed.token_data.expect("the rendered prompt goes on to the frontend");
        assert!(!tokens.is_empty());
        let Route::Pinned(pinned) = routed.route else { panic!("disaggregated serving pins") };
        assert_eq!(pinned.selection.decode.worker.instance_id, 7);
        let counted = |result: &str| state.metrics.kv_selections.with_label_values(&[result]).get();
        // Refused at once, or past the 10 ms deadline on a busy machine: a miss either way.
        assert_eq!(counted("index_unavailable") + counted("index_timeout"), 1, "counted as the miss it was");
        assert_eq!(counted("no_overlap"), 0);
        let by_formula = state.metrics.selections.with_label_values(&["decode", "kv_aware"]).get();
        assert_eq!(by_formula, 1, "the KV formula chose the worker, not the load-only rules");
        let factor = state.ledger.prompt_sizes().factor("tiny");
        assert_ne!(factor, 1.0, "the rendered count calibrates the estimate of prompts without one");
        let one_answer = PromptSizes::default();
        one_answer.learn("tiny", request.prompt_estimate, tokens.len() as u64);
        assert_eq!(factor, one_answer.factor("tiny"), "one observation: the prompt's estimate against its tokens");
        // The lookup went out, and the control plane may have reserved a rank for it: the
        // dispatch names it all the same, so that reservation follows the request.
        let first = reports.try_recv().expect("the dispatch is reported");
        let report = crate::fleet::batch(first, &mut reports);
        let lookups: Vec<u64> = report.started.iter().map(|started| started.lookup).collect();
        assert!(
            matches!(lookups[..], [lookup] if lookup != 0),
            "the lookup's number, on the leg that prefills: {lookups:?}"
        );
        let buffered: Vec<bool> = report.started.iter().map(|started| started.buffered).collect();
        assert_eq!(buffered, [true], "no `stream` in the body: its answer comes whole");
    }

    /// The pick runs on the view after the render: a worker there whose card names other
    /// files, or other prompt defaults (it joined with them meanwhile, in a rolling upgrade),
    /// is not sent tokens rendered with the old ones; its frontend tokenizes the prompt itself.
    #[tokio::test]
    async fn tokens_rendered_with_other_files_or_defaults_than_the_chosen_workers_are_not_sent() {
        type Change = fn(&mut continuum_proto::model::ModelArtifacts);
        let changes: [(&str, Change); 2] = [
            ("files", |card| {
                if let Some(tokenizer) = card.tokenizer.as_mut() {
                    tokenizer.checksum = crate::kv::artifacts::Checksum::of(b"another tokenizer").to_string();
                }
            }),
            ("defaults", |card| {
                card.defaults.default_thinking = Some(!card.defaults.default_thinking.unwrap_or(false))
            }),
        ];
        for (what, change) in changes {
            let state = AppState::for_tests();
            let dir = tempfile::tempdir().expect("dir");
            let fleet = tinymodel_fleet(&state, &dir).await;
            let (mut upgraded, pinned) = tinymodel_card();
            change(&mut upgraded);
            let body = Bytes::from_static(br#"{"model":"tiny","messages":[{"role":"user","content":"hello there"}]}"#);
            let request = ChatRequest::parse(body).expect("request");
            // While the prompt was rendered, worker 7 left and worker 8 came with other ones.
            state.fleet.store(kv_view(2, 8, Some(upgraded), &dir.path().display().to_string(), pinned));
            let routed = route(&state, &fleet, &request).await.expect("routed");
            let Route::Pinned(pinned) = routed.route else { panic!("disaggregated serving pins") };
            assert_eq!(pinned.selection.decode.worker.instance_id, 8, "{what}");
            assert!(routed.token_data.is_none(), "tokens of the old {what} are not worker 8's prompt");
        }
    }

    /// Requests whose bodies are `bytes` long, as many as fill `budget` bytes of trees while
    /// they are held (as renders that outlived their deadline hold theirs).
    fn filling(bytes: usize, budget: usize) -> Vec<ChatRequest> {
        let envelope = r#"{"model":"tiny","messages":[{"role":"user","content":""}]}"#.len();
        let content = "x".repeat(bytes - envelope);
        let body = format!(r#"{{"model":"tiny","messages":[{{"role":"user","content":"{content}"}}]}}"#);
        (0..budget / body.len()).map(|_| ChatRequest::parse(Bytes::from(body.clone())).expect("request")).collect()
    }

    /// Large bodies holding all the room for theirs leave a small request its KV term; small
    /// ones holding all of theirs make it go without, at once.
    #[tokio::test]
    async fn a_request_finding_no_room_for_its_tree_is_picked_on_its_estimate_at_once() {
        let _filling = crate::memory::FILLING.lock().await;
        use crate::ingress::request::{MAX_SMALL_TREE_BYTES_IN_FLIGHT, MAX_TREE_BYTES_IN_FLIGHT, ON_THE_RUNTIME_BYTES};
        let state = AppState::for_tests();
        let dir = tempfile::tempdir().expect("dir");
        let fleet = tinymodel_fleet(&state, &dir).await;
        let counted = |result: &str| state.metrics.kv_selections.with_label_values(&[result]).get();
        let body = Bytes::from_static(br#"{"model":"tiny","messages":[{"role":"user","content":"hello there"}]}"#);
        let request = ChatRequest::parse(body).expect("request");
        let mut held = Vec::new();
        for large in &filling(crate::ingress::MAX_REQUEST_BODY_BYTES, MAX_TREE_BYTES_IN_FLIGHT) {
            held.push(large.tree().await.expect("a tree"));
        }
        let routed = route(&state, &fleet, &request).await.expect("routed");
        drop(routed);
        assert_eq!(counted("render_unavailable"), 0, "small requests do not wait behind large ones");
        for small in &filling(ON_THE_RUNTIME_BYTES, MAX_SMALL_TREE_BYTES_IN_FLIGHT) {
            held.push(small.tree().await.expect("a tree"));
        }
        let routed = tokio::time::timeout(Duration::from_secs(5), route(&state, &fleet, &request))
            .await
            .expect("not held until room comes")
            .expect("routed");
        assert!(routed.token_data.is_none(), "nothing rendered");
        assert_eq!(counted("render_unavailable"), 1);
        drop(held);
    }

    #[tokio::test]
    async fn the_tenant_salts_the_prompt_blocks_over_the_body_salt_as_the_frontend_does() {
        let state = AppState::for_tests();
        let mut reports = state.reporter.attached_receiver().expect("the reports");
        let dir = tempfile::tempdir().expect("dir");
        let fleet = tinymodel_fleet(&state, &dir).await;
        // Long enough for several full blocks of 16 tokens.
        let content = "the quick brown fox jumps over the lazy dog ".repeat(8);
        let mut hashes = async |salt: Option<&str>, tenant: Option<&str>| {
            let nvext = salt.map(|salt| format!(r#","nvext":{{"cache_salt":"{salt}"}}"#)).unwrap_or_default();
            let body = format!(r#"{{"model":"tiny","messages":[{{"role":"user","content":"{content}"}}]{nvext}}}"#);
            let request =
                ChatRequest::parse(Bytes::from(body)).expect("request").with_tenant(tenant.map(str::to_owned));
            let routed = route(&state, &fleet, &request).await.expect("routed");
            drop(routed);
            let first = reports.try_recv().expect("the dispatch is reported");
            let report = crate::fleet::batch(first, &mut reports);
            let started = report.started.first().expect("a started dispatch");
            assert!(started.block_hashes.len() >= 2, "full blocks: {:?}", started.block_hashes);
            started.block_hashes.clone()
        };
        let unsalted = hashes(None, None).await;
        let tenant = hashes(None, Some("acme")).await;
        assert_ne!(tenant, unsalted, "a tenant's blocks are its own");
        assert_eq!(hashes(Some("acme"), None).await, tenant, "the tenant is the salt the body would give");
        assert_eq!(hashes(Some("other"), Some("acme")).await, tenant, "the header wins over the body");
        assert_ne!(hashes(Some("other"), None).await, tenant);
    }
}
