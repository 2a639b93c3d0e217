//! Which worker ranks may serve a request, by the seed's mixed-namespace rules.
//!
//! Dynamo serves no pair of a prefill worker and an aggregated worker. So, per namespace and
//! model: a namespace with prefill AND decode workers pairs them, and its aggregated workers
//! are not decode candidates; in any other namespace decode and aggregated workers are decode
//! candidates. A worker of unknown role is never routed to. Each dp rank is one candidate.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use continuum_proto::model::{LoadKey, Role, Worker};
use continuum_proto::view::{FleetView, WorkersMemo};

use super::Pin;
use super::outliers::Outliers;

/// One (worker, dp rank), with the keys the picker looks it up by, built once with its pool.
#[derive(Clone, Debug)]
pub(super) struct Candidate {
    pub worker: Arc<Worker>,
    pub rank: u32,
    /// The key its load samples, backlogs and outlier record are kept under.
    pub load_key: LoadKey,
    /// The key this replica's ledger keeps its dispatches under: its pin's rank.
    pub pin_key: LoadKey,
    /// A decode worker beside prefill workers: a request reaches it by hand-over, once a
    /// prefill elsewhere has ended. One whose namespace has none prefills its own requests.
    pub hands_over: bool,
}

impl Candidate {
    pub fn new(worker: Arc<Worker>, rank: u32) -> Self {
        let load_key = LoadKey { worker: worker.key.clone(), dp_rank: rank };
        let pin_key = pin_of(&worker, rank).rank_key();
        Self { worker, rank, load_key, pin_key, hands_over: false }
    }

    pub fn pin(&self) -> Pin {
        pin_of(&self.worker, self.rank)
    }
}

/// A rank is pinned only when its worker declares data parallelism.
fn pin_of(worker: &Worker, rank: u32) -> Pin {
    Pin { worker: worker.key.clone(), dp_rank: (worker.dp_size > 0).then_some(rank) }
}

/// The decode candidates of every eligible namespace, compared together (graph-local
/// dispatch), and each namespace's prefill pool, searched only in the decode winner's.
#[derive(Clone, Debug, Default)]
pub(super) struct Pools {
    pub decode: Vec<Candidate>,
    pub prefill: BTreeMap<Arc<str>, Vec<Candidate>>,
}

impl Pools {
    /// Drops the ranks this replica's pinned dispatches keep failing on, per list, at most a
    /// third of it and never all ([`Outliers::filter`]). Shared pools are copied only when
    /// some rank is ejected.
    pub fn skip_ejected(self: Arc<Self>, outliers: &Outliers, now: Instant) -> Arc<Self> {
        if !outliers.any_ejected(now) {
            return self;
        }
        let mut pools = Arc::unwrap_or_clone(self);
        outliers.filter(&mut pools.decode, |c| c.load_key.clone(), now);
        for pool in pools.prefill.values_mut() {
            outliers.filter(pool, |c| c.load_key.clone(), now);
        }
        Arc::new(pools)
    }
}

/// (Model, namespace filter) pairs whose pools are kept at once; past it the cache starts over.
/// Models and shim namespaces come from the operator's configuration, so a handful is usual.
pub(super) const MAX_CACHED_POOLS: usize = 256;

/// Each model's pools, listed once per set of workers rather than per request: the fleet's
/// workers change far less often than requests arrive, and listing them costs O(fleet).
#[derive(Debug, Default)]
pub(super) struct PoolCache {
    held: Mutex<WorkersMemo<Listed>>,
}

/// A namespace filter (`None`: all namespaces) and the pools it leaves.
type Filtered = (Option<Vec<String>>, Arc<Pools>);

#[derive(Debug, Default)]
struct Listed {
    by_model: HashMap<String, Vec<Filtered>>,
    entries: usize,
}

impl PoolCache {
    /// The pools of `model` among `namespaces` (`None`: all) in `view`, as [`pools`] lists them.
    pub fn get(&self, view: &FleetView, model: &str, namespaces: Option<&[String]>) -> Arc<Pools> {
        let mut memo = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let held = memo.for_view(view);
        let listed = held.by_model.get(model).and_then(|lists| lists.iter().find(|(f, _)| f.as_deref() == namespaces));
        if let Some((_, pools)) = listed {
            return Arc::clone(pools);
        }
        let listed = Arc::new(pools(view, model, namespaces));
        // A model no worker serves is not kept: its name is the client's, of any length.
        if listed.decode.is_empty() {
            return listed;
        }
        if held.entries >= MAX_CACHED_POOLS {
            held.by_model.clear();
            held.entries = 0;
        }
        held.entries += 1;
        let filter = namespaces.map(<[String]>::to_vec);
        held.by_model.entry(model.to_string()).or_default().push((filter, Arc::clone(&listed)));
        listed
    }

    /// Listings held for `view`'s workers.
    #[cfg(test)]
    pub fn held(&self, view: &FleetView) -> usize {
        self.held.lock().unwrap_or_else(PoisonError::into_inner).for_view(view).entries
    }
}

#[derive(Debug, Default)]
struct ByRole {
    prefill: Vec<Arc<Worker>>,
    decode: Vec<Arc<Worker>>,
    aggregated: Vec<Arc<Worker>>,
}

/// Ranks of one model a pick weighs at most, decode and prefill together: as many as the
/// control plane's load store holds samples for, for every model together. Without a bound, a
/// fleet of many workers each declaring 1,024 dp ranks (a card anyone able to register a worker
/// can write) would cost every replica a candidate per rank, gigabytes for each model.
pub(super) const MAX_CANDIDATE_RANKS: usize = 65_536;

pub(super) fn pools(view: &FleetView, model: &str, namespaces: Option<&[String]>) -> Pools {
    let allowed = |worker: &Worker| namespaces.is_none_or(|names| names.iter().any(|n| *n == *worker.key.namespace));
    let mut by_namespace: BTreeMap<Arc<str>, ByRole> = BTreeMap::new();
    for worker in view.workers().values().filter(|w| w.model == model && allowed(w)) {
        let roles = by_namespace.entry(Arc::clone(&worker.key.namespace)).or_default();
        match worker.role {
            Role::Prefill => roles.prefill.push(Arc::clone(worker)),
            Role::Decode => roles.decode.push(Arc::clone(worker)),
            Role::Aggregated => roles.aggregated.push(Arc::clone(worker)),
            Role::Unknown => {}
        }
    }
    let mut pools = Pools::default();
    let (mut room, mut left_out) = (MAX_CANDIDATE_RANKS, false);
    // Namespace by namespace, a namespace's prefill pool before its decode workers: past the
    // bound a namespace is left out whole or its decode workers in part, and a decode worker
    // listed always has prefill candidates beside it.
    for (namespace, roles) in by_namespace {
        if room == 0 {
            left_out = true;
            break;
        }
        let pairs = !roles.prefill.is_empty() && !roles.decode.is_empty();
        let aggregated = if pairs { &[][..] } else { &roles.aggregated[..] };
        // Prefill workers without decode workers beside them pair with nobody (an aggregated
        // winner prefills itself): listed, they would only take room from those who serve.
        if pairs {
            pools.prefill.insert(namespace, take(roles.prefill.iter(), &mut room, &mut left_out));
        }
        let decode = take(roles.decode.iter().chain(aggregated), &mut room, &mut left_out);
        pools.decode.extend(decode.into_iter().map(|candidate| Candidate { hands_over: pairs, ..candidate }));
    }
    if left_out {
        tracing::warn!(
            model,
            limit = MAX_CANDIDATE_RANKS,
            "the model's workers declare more dp ranks than a pick weighs; the ranks past the limit are left out"
        );
    }
    pools
}

/// The ranks of `workers` that fit in `room`, which shrinks by as many; `left_out` is set if
/// some did not fit.
fn take<'a>(workers: impl Iterator<Item = &'a Arc<Worker>>, room: &mut usize, left_out: &mut bool) -> Vec<Candidate> {
    let mut all = ranks(workers);
    let taken: Vec<Candidate> = all.by_ref().take(*room).collect();
    *room -= taken.len();
    *left_out |= all.next().is_some();
    taken
}

fn ranks<'a>(workers: impl Iterator<Item = &'a Arc<Worker>>) -> impl Iterator<Item = Candidate> {
    workers.flat_map(|worker| worker.dp_ranks().map(|rank| Candidate::new(Arc::clone(worker), rank)))
}
