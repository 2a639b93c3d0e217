use std::time::{Duration, Instant};

use continuum_proto::STALL_AFTER;
use continuum_proto::model::{Capacity, DataPlaneConfig, Load, LoadSample, Worker, WorkerKey};

use futures::FutureExt;
use prometheus::IntCounter;
use tokio_util::sync::CancellationToken;

use super::*;
use crate::fleet::{ActiveIndex, FleetPublisher};

/// Whether `report` was queued at once: without waiting for room (which would let the book's
/// task run and make some).
fn queued_now(report: impl std::future::Future<Output = Result<(), NotQueued>>) -> bool {
    report.now_or_never() == Some(Ok(()))
}

fn state_with(dp_size: u32) -> FleetState {
    let state = FleetState::new(1, Arc::new(DataPlaneConfig::default()));
    match state.commit(FleetChange { upsert: vec![decode_worker(dp_size)], ..FleetChange::default() }) {
        Some((state, _)) => state,
        None => panic!("upsert is a change"),
    }
}

fn decode_worker(dp_size: u32) -> Arc<Worker> {
    crate::fleet::test_worker(1, dp_size)
}

fn rank(dp_rank: u32) -> LoadKey {
    LoadKey { worker: WorkerKey::new("dynamo", 1), dp_rank }
}

/// The book's key for `rank(dp_rank)`.
fn book_key(dp_rank: u32) -> RankKey {
    RankKey { worker_id: 1, dp_rank }
}

fn started(id: u64, dp_rank: u32, tokens: u64) -> pb::DispatchStarted {
    let rank = Some((&rank(dp_rank)).into());
    pb::DispatchStarted {
        id,
        rank,
        prefill_tokens: tokens,
        decode_blocks: tokens / 16,
        ..pb::DispatchStarted::default()
    }
}

fn report(started: Vec<pb::DispatchStarted>, ended: Vec<u64>) -> pb::DispatchReport {
    pb::DispatchReport { started, ended, ..pb::DispatchReport::default() }
}

/// A report of `started` that carries its replica's operations `first_op` to `last_op`.
fn numbered(first_op: u64, last_op: u64, started: Vec<pb::DispatchStarted>) -> pb::DispatchReport {
    pb::DispatchReport { started, first_op, last_op, ..pb::DispatchReport::default() }
}

fn sampled(state: &FleetState, dp_rank: u32, kv_used_blocks: u64, received_at: Instant) -> FleetState {
    let sample = LoadSample { load: Load { kv_used_blocks: Some(kv_used_blocks), ..Load::default() }, received_at };
    match state.commit(FleetChange { loads: vec![(rank(dp_rank), sample)], ..FleetChange::default() }) {
        Some((state, _)) => state,
        None => panic!("a sample is a change"),
    }
}

/// A report of dispatch `id`'s first token.
fn first_token(id: u64) -> pb::DispatchReport {
    pb::DispatchReport { prefilled: vec![id], ..Default::default() }
}

/// Rank 0's (prefill tokens, of them prefilled) after a publish check at `at`.
fn prefill_sums(book: &mut Book, state: &FleetState, at: Instant) -> Option<(u64, u64)> {
    book.expire(state, at);
    book.take_change(at);
    book.ranks.get(&book_key(0)).map(|r| r.backlog()).map(|b| (b.prefill_tokens, b.prefilled_tokens))
}

/// (dp rank, prefill tokens, decode blocks, dispatches, foreign decode blocks) per published rank.
fn sums(change: &FleetChange) -> Vec<(u32, u64, u64, u32, Option<u64>)> {
    change
        .backlogs
        .iter()
        .map(|(k, b)| (k.dp_rank, b.prefill_tokens, b.decode_blocks, b.dispatches, b.foreign_decode_blocks))
        .collect()
}

#[test]
fn reports_from_several_replicas_sum_per_rank_and_ends_subtract() {
    let state = state_with(2);
    let mut book = Book::default();
    let t0 = Instant::now();
    book.report(1, report(vec![started(1, 0, 160), started(2, 1, 32)], vec![]), t0, &state);
    book.report(2, report(vec![started(1, 0, 320)], vec![]), t0, &state);
    let change = book.take_change(t0);
    assert_eq!(sums(&change), [(0, 480, 30, 2, None), (1, 32, 2, 1, None)], "replica ids are separate id spaces");

    book.report(1, report(vec![], vec![1, 2]), t0, &state);
    let change = book.take_change(t0);
    assert_eq!(sums(&change), [(0, 320, 20, 1, None), (1, 0, 0, 0, None)]);
    assert!(change.backlogs_removed.is_empty(), "an end is published until a sample shows it");

    let later = t0 + SAMPLE_LAG;
    let shown = sampled(&sampled(&state, 1, 0, later), 0, 20, later);
    book.expire(&shown, later);
    let change = book.take_change(later);
    assert!(!book.ranks.contains_key(&book_key(1)), "a rank settled by a sample after its last end leaves the book");
    assert_eq!(
        sums(&change),
        [(0, 320, 20, 1, Some(0))],
        "a sample changes neither the prefill nor the decode sums; rank 1 was published in its settled form already"
    );
}

#[test]
fn a_settled_rank_keeps_only_its_place_in_the_dispatch_order() {
    let t0 = Instant::now();
    let state = sampled(&state_with(0), 0, 3, t0);
    let mut book = Book::default();
    book.report(1, report(vec![started(1, 0, 160)], vec![]), t0, &state);
    assert_eq!(sums(&book.take_change(t0)), [(0, 160, 10, 1, Some(3))]);
    let ended = t0 + Duration::from_millis(40);
    book.report(1, report(vec![], vec![1]), ended, &state);
    // A sample within the lag may still show the ended request: the sums stay.
    let early = sampled(&state, 0, 13, ended + SAMPLE_LAG / 2);
    book.expire(&early, ended + SAMPLE_LAG / 2);
    assert_eq!(sums(&book.take_change(ended + SAMPLE_LAG / 2)), [(0, 0, 0, 0, Some(3))]);
    let shown = sampled(&early, 0, 3, ended + SAMPLE_LAG);
    book.expire(&shown, ended + SAMPLE_LAG);
    let change = book.take_change(ended + SAMPLE_LAG);
    assert_eq!(change.backlogs, [(rank(0), Backlog { last_dispatch: 1, ..Backlog::default() })]);
    assert!(book.ranks.is_empty());
    // A replay, which takes no place in the order, brings it back at the place it had.
    let replay = pb::DispatchStarted { replayed: true, age_ms: 10, ..started(9, 0, 16) };
    book.report(3, report(vec![replay], vec![]), ended + SAMPLE_LAG, &shown);
    let change = book.take_change(ended + SAMPLE_LAG);
    assert_eq!(change.backlogs.iter().map(|(_, b)| b.last_dispatch).collect::<Vec<_>>(), [1], "not idle longest");
    // The next dispatch anywhere is numbered after it.
    book.report(2, report(vec![started(1, 0, 16)], vec![]), ended + SAMPLE_LAG, &shown);
    let change = book.take_change(ended + SAMPLE_LAG);
    assert_eq!(change.backlogs.iter().map(|(_, b)| b.last_dispatch).collect::<Vec<_>>(), [2]);
}

#[test]
fn each_ranks_newest_dispatch_is_stamped_with_the_books_count() {
    let state = state_with(2);
    let mut book = Book::default();
    let t0 = Instant::now();
    let newest = |change: &FleetChange| -> Vec<(u32, u64)> {
        change.backlogs.iter().map(|(k, b)| (k.dp_rank, b.last_dispatch)).collect()
    };
    book.report(1, report(vec![started(1, 0, 16), started(2, 1, 16)], vec![]), t0, &state);
    assert_eq!(newest(&book.take_change(t0)), [(0, 1), (1, 2)]);
    // Another replica's dispatch to rank 0 makes it the more recent one; an end changes nothing.
    book.report(2, report(vec![started(1, 0, 16)], vec![]), t0, &state);
    book.report(1, report(vec![], vec![1]), t0, &state);
    assert_eq!(newest(&book.take_change(t0)), [(0, 3)]);
    let mut stranger = started(3, 0, 16);
    stranger.rank = Some((&LoadKey { worker: WorkerKey::new("dynamo", 99), dp_rank: 0 }).into());
    book.report(1, report(vec![stranger, started(4, 1, 16)], vec![]), t0, &state);
    assert_eq!(newest(&book.take_change(t0)), [(1, 4)], "a refused dispatch takes no number");
}

#[test]
fn reports_for_ranks_the_fleet_does_not_have_are_refused() {
    let state = state_with(0);
    let mut book = Book::default();
    book.report(1, report(vec![started(1, 3, 16)], vec![]), Instant::now(), &state);
    let mut stranger = started(2, 0, 16);
    stranger.rank = Some((&LoadKey { worker: WorkerKey::new("dynamo", 99), dp_rank: 0 }).into());
    book.report(1, report(vec![stranger], vec![]), Instant::now(), &state);
    let nowhere = pb::DispatchStarted { rank: None, ..started(3, 0, 16) };
    book.report(1, report(vec![nowhere], vec![]), Instant::now(), &state);
    assert_eq!((book.refused.of(Refusal::UnknownRank), book.refused.total()), (3, 3));
    assert!(book.take_change(Instant::now()).backlogs.is_empty());
}

/// Starts that name their rank by its place in the report's `ranks` land on it, as starts that
/// name it themselves (replicas before the table) do; a place past the table's end is no rank.
#[test]
fn starts_name_their_rank_by_its_place_in_the_reports_table() {
    let state = state_with(2);
    let mut book = Book::default();
    let t0 = Instant::now();
    let by_place = |id, rank_index| pb::DispatchStarted { rank: None, rank_index, ..started(id, 0, 16) };
    let table = pb::DispatchReport {
        ranks: vec![(&rank(1)).into(), (&rank(0)).into()],
        ..report(vec![by_place(1, 0), by_place(2, 1), by_place(3, 0), started(4, 0, 16), by_place(5, 2)], vec![])
    };
    book.report(1, table, t0, &state);
    assert_eq!((book.refused.of(Refusal::UnknownRank), book.refused.total()), (1, 1), "place 2 of 2");
    let mut placed: Vec<(u64, RankKey)> = book.where_is[&1].iter().map(|(id, key)| (*id, *key)).collect();
    placed.sort_by_key(|(id, _)| *id);
    assert_eq!(placed, [(1, book_key(1)), (2, book_key(0)), (3, book_key(1)), (4, book_key(0))]);
}

/// A table entry the fleet does not have refuses every start naming it (found out once a
/// report: a thousand starts naming one huge unknown entry cost one look, not a thousand
/// copies of it), and the entries beside it still take theirs.
#[test]
fn every_start_naming_an_unknown_table_entry_is_refused_and_the_rest_land() {
    let state = state_with(1);
    let mut book = Book::default();
    let by_place = |id, rank_index| pb::DispatchStarted { rank: None, rank_index, ..started(id, 0, 16) };
    let huge = LoadKey { worker: WorkerKey::new("n".repeat(1 << 20).as_str(), 99), dp_rank: 0 };
    let mut starts: Vec<pb::DispatchStarted> = (1..=1_000).map(|id| by_place(id, 0)).collect();
    starts.push(by_place(1_001, 1));
    let table = pb::DispatchReport { ranks: vec![(&huge).into(), (&rank(0)).into()], ..report(starts, vec![]) };
    book.report(1, table, Instant::now(), &state);
    assert_eq!((book.refused.of(Refusal::UnknownRank), book.refused.total()), (1_000, 1_000));
    assert_eq!(book.where_is[&1].keys().copied().collect::<Vec<_>>(), [1_001]);
}

#[test]
fn a_held_rank_takes_reports_only_under_its_own_namespace_and_while_its_worker_serves() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    book.report(1, report(vec![started(1, 0, 16)], vec![]), t0, &state);
    // The book finds the held rank by its instance id; the same id under another namespace
    // (or none) is not that rank.
    let mut impostor = started(2, 0, 16);
    impostor.rank = Some((&LoadKey { worker: WorkerKey::new("other", 1), dp_rank: 0 }).into());
    let mut unnamed = started(3, 0, 16);
    unnamed.rank =
        Some(pb::LoadKey { worker: Some(pb::WorkerKey { namespace: String::new(), instance_id: 1 }), dp_rank: 0 });
    book.report(1, report(vec![impostor, unnamed], vec![]), t0, &state);
    assert_eq!(book.refused.of(Refusal::UnknownRank), 2);
    // Once the worker has left the fleet, its held rank takes no new dispatch.
    let Some((gone, _)) =
        state.commit(FleetChange { remove: vec![WorkerKey::new("dynamo", 1)], ..FleetChange::default() })
    else {
        panic!("a removal is a change")
    };
    book.report(1, report(vec![started(4, 0, 16)], vec![]), t0, &gone);
    assert_eq!(book.refused.of(Refusal::UnknownRank), 3);
    assert_eq!(book.where_is[&1].keys().copied().collect::<Vec<_>>(), [1]);
}

#[test]
fn prefill_counts_until_the_first_token_and_decode_until_the_end() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    book.report(1, report(vec![started(1, 0, 160), started(2, 0, 32)], vec![]), t0, &state);
    assert_eq!(sums(&book.take_change(t0)), [(0, 192, 12, 2, None)]);
    book.report(1, pb::DispatchReport { prefilled: vec![1], ..Default::default() }, t0, &state);
    assert_eq!(sums(&book.take_change(t0)), [(0, 32, 12, 2, None)]);
    book.report(1, report(vec![], vec![1]), t0, &state);
    assert_eq!(sums(&book.take_change(t0)), [(0, 32, 2, 1, None)]);
}

#[test]
fn a_dispatch_that_starts_and_ends_within_one_report_leaves_nothing() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    let whole = pb::DispatchReport {
        started: vec![started(1, 0, 160)],
        ended: vec![1],
        prefilled: vec![1],
        ..Default::default()
    };
    book.report(1, whole, t0, &state);
    assert_eq!(sums(&book.take_change(t0)), [(0, 0, 0, 0, None)]);
    assert_eq!(book.held, 0);
}

/// The herd this accounting exists to stop: a burst's requests all end, but the worker's last
/// sample was taken before they did and still shows their blocks. Read as "sample plus new
/// dispatches", every replica would send the next burst to the other worker.
#[test]
fn a_sample_that_still_shows_ended_requests_counts_nothing_for_them() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    let burst = (1..=8).map(|id| started(id, 0, 1600)).collect();
    book.report(1, report(burst, vec![]), t0, &state);
    // The engine holds all eight (800 blocks) when it publishes.
    let busy = sampled(&state, 0, 800, t0 + Duration::from_millis(300));
    book.expire(&busy, t0 + Duration::from_millis(301));
    assert_eq!(sums(&book.take_change(t0)), [(0, 12800, 800, 8, Some(0))], "all of the sample is the fleet's own");
    // All eight end; no sample since.
    book.report(1, report(vec![], (1..=8).collect()), t0 + Duration::from_millis(600), &busy);
    book.expire(&busy, t0 + Duration::from_millis(601));
    let change = book.take_change(t0 + Duration::from_millis(601));
    assert_eq!(sums(&change), [(0, 0, 0, 0, Some(0))], "backlog 0 + 0, not the sample's 800");
    // A sample published before the ends but received after them still shows them: not foreign.
    let late = sampled(&busy, 0, 800, t0 + Duration::from_millis(650));
    book.expire(&late, t0 + Duration::from_millis(651));
    assert_eq!(sums(&book.take_change(t0)), [], "foreign stays 0");
    // Past the lag, what a sample shows is the worker's.
    let later = t0 + Duration::from_millis(600) + SAMPLE_LAG;
    book.report(1, report(vec![started(9, 0, 160)], vec![]), later, &late);
    let other = sampled(&late, 0, 50, later + Duration::from_millis(1));
    book.expire(&other, later + Duration::from_millis(2));
    assert_eq!(sums(&book.take_change(later)), [(0, 160, 10, 1, Some(40))]);
}

/// The other lag: a new request has not reached the engine when its worker publishes, so the
/// sample does not show it; the request's blocks still count.
#[test]
fn a_sample_taken_before_a_request_arrived_does_not_erase_it() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    book.report(1, report(vec![started(1, 0, 1600)], vec![]), t0, &state);
    let early = sampled(&state, 0, 0, t0 + Duration::from_millis(2));
    book.expire(&early, t0 + Duration::from_millis(3));
    assert_eq!(sums(&book.take_change(t0)), [(0, 1600, 100, 1, Some(0))], "100 blocks in flight, none foreign");
}

#[test]
fn load_the_fleet_did_not_send_is_foreign() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    // Another router keeps 300 blocks busy on the rank.
    let other = sampled(&state, 0, 300, t0);
    book.report(1, report(vec![started(1, 0, 1600)], vec![]), t0 + Duration::from_millis(1), &other);
    assert_eq!(sums(&book.take_change(t0)), [(0, 1600, 100, 1, Some(300))], "a new record counts the sample whole");
    let both = sampled(&other, 0, 400, t0 + Duration::from_millis(50));
    book.expire(&both, t0 + Duration::from_millis(51));
    assert_eq!(sums(&book.take_change(t0)), [], "foreign: 400 shown - 100 in flight, unchanged");
}

/// A start repeating a live dispatch's id (a broken replica) replaces it: the rank counts the
/// one dispatch once, with no part of it left over as foreign load.
#[test]
fn a_repeated_start_replaces_its_dispatch_without_counting_it_twice() {
    let t0 = Instant::now();
    let state = sampled(&state_with(0), 0, 0, t0);
    let mut book = Book::default();
    let later = t0 + Duration::from_millis(1);
    book.report(1, report(vec![started(1, 0, 1600)], vec![]), later, &state);
    let shown = sampled(&state, 0, 100, later + Duration::from_millis(1));
    book.expire(&shown, later + Duration::from_millis(1));
    assert_eq!(sums(&book.take_change(later)), [(0, 1600, 100, 1, Some(0))], "the sample shows it, none foreign");
    book.report(1, report(vec![started(1, 0, 1600)], vec![]), later + Duration::from_millis(2), &shown);
    book.expire(&shown, later + Duration::from_millis(2));
    let change = book.take_change(later);
    assert!(sums(&change).iter().all(|s| *s == (0, 1600, 100, 1, Some(0))), "once, none foreign: {:?}", sums(&change));
    assert_eq!(book.ranks.get(&book_key(0)).map(|r| r.backlog().decode_blocks), Some(100));
    assert_eq!(book.ranks.get(&book_key(0)).map(|r| r.backlog().foreign_decode_blocks), Some(Some(0)));
}

/// A dispatch a replica reports again on a new stream (`replayed`, begun `age_ms` before the
/// report): counted in the sums as any other, and measured against samples from when it began,
/// so a sample taken since does not count it as foreign load. It is not the rank's newest
/// dispatch, and its first token and end teach the rank no times, since the book did not see it
/// start.
#[test]
fn a_replayed_dispatch_counts_from_when_it_began_and_teaches_no_times() {
    let state = state_with(0);
    let mut book = Book::default();
    let ms = Duration::from_millis;
    let t0 = Instant::now();
    // The worker's sample, taken after the dispatch began and showing its 100 blocks.
    let shown = sampled(&state, 0, 100, t0 + ms(300));
    let replayed = pb::DispatchStarted { replayed: true, age_ms: 500, ..started(1, 0, 1600) };
    book.report(1, report(vec![replayed], vec![]), t0 + ms(400), &shown);
    let change = book.take_change(t0 + ms(400));
    assert_eq!(sums(&change), [(0, 1600, 100, 1, Some(0))], "in flight when the sample was taken: none foreign");
    assert_eq!(change.backlogs[0].1.last_dispatch, 0, "not the rank's newest dispatch");
    let fresh = pb::DispatchStarted { ..started(2, 0, 1600) };
    book.report(2, report(vec![fresh], vec![]), t0 + ms(400), &shown);
    assert_eq!(sums(&book.take_change(t0 + ms(400))), [(0, 3200, 200, 2, Some(0))]);

    let prefilled = pb::DispatchReport { prefilled: vec![1], ended: vec![], ..Default::default() };
    book.report(1, prefilled, t0 + ms(450), &shown);
    book.report(1, report(vec![], vec![1]), t0 + ms(900), &shown);
    let timing = book.ranks.get(&book_key(0)).map(|r| (r.timing.first_token, r.timing.decode));
    assert_eq!(timing, Some((None, None)), "neither its first token nor its end is a measurement");
    let counters = (book.replayed, book.dispatched);
    assert_eq!(counters, (1, 1), "one replayed, one dispatched");
}

/// A report's events share its instant: a first token or an end in the report that started
/// (or answered) its dispatch measures nothing, however many such reports a replica sends.
#[test]
fn a_dispatch_answered_or_ended_within_one_report_teaches_no_times() {
    let state = state_with(0);
    let mut book = Book::default();
    let ms = Duration::from_millis;
    let t0 = Instant::now();
    let timing =
        |book: &Book| book.ranks.get(&book_key(0)).map_or((None, None), |r| (r.timing.first_token, r.timing.decode));
    for id in 1..=8 {
        let at = t0 + ms(id);
        let whole =
            pb::DispatchReport { prefilled: vec![id], ended: vec![id], ..report(vec![started(id, 0, 1600)], vec![]) };
        book.report(1, whole, at, &state);
    }
    assert_eq!(timing(&book), (None, None), "nothing measured");
    book.report(1, report(vec![started(9, 0, 1600)], vec![]), t0 + ms(100), &state);
    book.report(
        1,
        pb::DispatchReport { prefilled: vec![9], ended: vec![9], ..Default::default() },
        t0 + ms(150),
        &state,
    );
    assert_eq!(timing(&book), (Some(ms(50)), None), "its first token, a report later; its end, not");
    book.report(1, report(vec![started(10, 0, 1600)], vec![]), t0 + ms(200), &state);
    book.report(1, first_token(10), t0 + ms(230), &state);
    book.report(1, report(vec![], vec![10]), t0 + ms(330), &state);
    assert!(timing(&book).1.is_some(), "an end a report after its first token is a decode time");
}

/// The foreign prefill tokens of each rank a change publishes.
fn foreign_prefill(change: &FleetChange) -> Vec<Option<u64>> {
    change.backlogs.iter().map(|(_, b)| b.foreign_prefill_tokens).collect()
}

/// A sample of an engine that counts its queued prompts (`active_prefill_tokens`).
fn queued(state: &FleetState, tokens: u64, at: Instant) -> FleetState {
    let load = Load { active_prefill_tokens: Some(tokens), kv_used_blocks: Some(0), ..Load::default() };
    match state
        .commit(FleetChange { loads: vec![(rank(0), LoadSample { load, received_at: at })], ..Default::default() })
    {
        Some((state, _)) => state,
        None => panic!("a sample is a change"),
    }
}

/// An engine that counts its queued prompts (SGLang, TensorRT-LLM) counts the fleet's
/// dispatches it has received; the fleet counts them until their first token. Only the rest
/// of what its sample shows is foreign.
#[test]
fn a_prefill_queue_the_sample_shares_with_the_fleet_counts_once() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    book.report(1, report(vec![started(1, 0, 160), started(2, 0, 320)], vec![]), t0, &state);
    // The engine shows both prompts queued and 100 tokens of someone else's.
    let busy = queued(&state, 580, t0 + Duration::from_millis(5));
    book.expire(&busy, t0 + Duration::from_millis(6));
    assert_eq!(foreign_prefill(&book.take_change(t0)), [Some(100)], "580 shown - 480 the fleet's");
    // The first prompt is answered; a sample soon after may still show it (the lag), and a
    // dispatch started after the sample arrived is not in it.
    book.report(
        1,
        pb::DispatchReport { prefilled: vec![1], ..Default::default() },
        t0 + Duration::from_millis(10),
        &busy,
    );
    book.report(1, report(vec![started(3, 0, 64)], vec![]), t0 + Duration::from_millis(12), &busy);
    let lagging = queued(&busy, 580, t0 + Duration::from_millis(11));
    book.expire(&lagging, t0 + Duration::from_millis(13));
    let change = book.take_change(t0 + Duration::from_millis(13));
    assert_eq!(foreign_prefill(&change), [Some(100)], "the answered prompt within the lag is still the fleet's");
    assert_eq!(change.backlogs[0].1.prefill_tokens, 320 + 64, "the fleet's queue: the unanswered prompts");
    // Past the lag, an answered prompt the sample still shows is the engine's own.
    let later = t0 + Duration::from_millis(10) + SAMPLE_LAG;
    let settled = queued(&lagging, 600, later + Duration::from_millis(1));
    book.expire(&settled, later + Duration::from_millis(2));
    assert_eq!(foreign_prefill(&book.take_change(later)), [Some(216)], "600 - 320 - 64");
    // A sample without the field measures nothing.
    let silent = sampled(&settled, 0, 10, later + Duration::from_millis(3));
    book.expire(&silent, later + Duration::from_millis(4));
    assert_eq!(foreign_prefill(&book.take_change(later)), [None]);
}

/// A prefill leg ends with its first token, so the book forgets it at once; a sample received
/// just after may still count its prompt. And a report that waited in the book's queue past
/// a sample it preceded is folded after the sample was measured.
#[test]
fn prompts_a_sample_may_still_count_are_not_foreign() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    book.report(1, report(vec![started(1, 0, 160), started(2, 0, 48)], vec![]), t0, &state);
    let answered_and_ended = pb::DispatchReport { prefilled: vec![1], ended: vec![1], ..Default::default() };
    book.report(1, answered_and_ended, t0 + Duration::from_millis(10), &state);
    // Published before the first token, received after the end: 160 + 48 shown, 16 foreign.
    let late = queued(&state, 224, t0 + Duration::from_millis(11));
    book.expire(&late, t0 + Duration::from_millis(12));
    assert_eq!(foreign_prefill(&book.take_change(t0)), [Some(16)], "224 - 48 in flight - 160 just answered");
    // Dispatch 3 was reported before the next sample arrived, but reaches the book after the
    // sample was measured: once folded, it is the fleet's, not foreign. (Past the lag, the
    // answered prompt no longer counts as the fleet's.)
    let t1 = t0 + Duration::from_millis(10) + SAMPLE_LAG;
    let next = queued(&late, 248, t1 + Duration::from_millis(11));
    book.expire(&next, t1 + Duration::from_millis(12));
    assert_eq!(foreign_prefill(&book.take_change(t0)), [Some(200)], "248 - 48, before dispatch 3 is folded");
    book.report(1, report(vec![started(3, 0, 32)], vec![]), t1 + Duration::from_millis(10), &next);
    assert_eq!(foreign_prefill(&book.take_change(t0)), [Some(168)], "its 32 tokens were the fleet's");
}

#[test]
fn unchanged_sums_are_not_published_again() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    book.report(1, report(vec![started(1, 0, 16)], vec![]), t0, &state);
    let change = book.take_change(t0);
    assert_eq!(change.backlogs.len(), 1);
    book.expire(&state, t0 + Duration::from_millis(2));
    assert!(book.take_change(t0).backlogs.is_empty());
}

#[test]
fn the_sums_say_which_of_each_replicas_operations_they_hold() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    // Replica 1's first report on this stream carries its operations 7 to 9 (it ran before).
    book.report(1, numbered(7, 9, vec![started(1, 0, 16)]), t0, &state);
    book.report(2, numbered(1, 1, vec![started(1, 0, 16)]), t0, &state);
    book.report(1, numbered(10, 12, vec![started(2, 0, 16)]), t0, &state);
    let folded = book.take_change(t0).reports_folded.expect("published with the sums");
    assert_eq!(folded.get(&1), Some(&ReportsFolded { first_op: 7, last_op: 12 }));
    assert_eq!(folded.get(&2), Some(&ReportsFolded { first_op: 1, last_op: 1 }));

    book.replica_gone(2, t0);
    let folded = book.take_change(t0).reports_folded.expect("published with the sums");
    assert_eq!(folded.get(&2), None, "a new stream starts a new range");
    assert_eq!(folded.len(), 1);
}

#[test]
fn dispatches_whose_end_never_comes_age_out_and_leave_with_their_replica() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    book.report(1, report(vec![started(1, 0, 16)], vec![]), t0, &state);
    book.report(2, report(vec![started(1, 0, 16)], vec![]), t0 + Duration::from_secs(20), &state);
    book.expire(&state, t0 + IN_FLIGHT_MAX_AGE);
    book.take_change(t0 + IN_FLIGHT_MAX_AGE);
    assert_eq!(book.ranks.get(&book_key(0)).map(|r| r.dispatches.len()), Some(1), "only the old dispatch aged out");
    book.replica_gone(2, t0 + IN_FLIGHT_MAX_AGE);
    assert!(book.ranks.get(&book_key(0)).is_some_and(|r| r.dispatches.is_empty()));
    // No sample ever comes: the record goes DISPATCH_MAX_AGE after the last dispatch left.
    let much_later = t0 + IN_FLIGHT_MAX_AGE + DISPATCH_MAX_AGE;
    book.expire(&state, much_later);
    let change = book.take_change(much_later);
    assert_eq!(change.backlogs, [(rank(0), Backlog { last_dispatch: 2, ..Backlog::default() })]);
    assert!(book.ranks.is_empty());
}

#[test]
fn a_replica_holds_a_bounded_number_of_dispatches() {
    let state = state_with(0);
    let mut book = Book::default();
    let many = (0..MAX_DISPATCHES_PER_REPLICA as u64 + 10).map(|id| started(id, 0, 16)).collect();
    book.report(1, report(many, vec![]), Instant::now(), &state);
    assert_eq!(book.held, MAX_DISPATCHES_PER_REPLICA);
    assert_eq!((book.refused.of(Refusal::ReplicaFull), book.refused.total()), (10, 10));
}

/// A report the book folds without moving a sum (its start refused here; a start and its end
/// in one report likewise) still goes out, as a version whose only news is which reports the
/// sums hold: a replica that hears nothing after reporting a start takes the control plane for
/// stuck and leaves it.
#[test]
fn a_report_folded_without_moving_a_sum_is_published_as_folded() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    let mut stranger = started(1, 0, 16);
    stranger.rank = Some((&LoadKey { worker: WorkerKey::new("dynamo", 99), dp_rank: 0 }).into());
    book.report(1, numbered(1, 1, vec![stranger]), t0, &state);
    let change = book.take_change(t0);
    assert!(change.backlogs.is_empty(), "no sum moved");
    let folded = change.reports_folded.clone().expect("published alone");
    assert_eq!(folded.get(&1), Some(&ReportsFolded { first_op: 1, last_op: 1 }));
    assert!(book.take_change(t0).reports_folded.is_none(), "once");
    let (next, delta) = state.commit(change).expect("a version of its own");
    assert!(delta.is_empty());
    assert_eq!(next.version(), state.version() + 1);
    assert_eq!(next.reports_folded(1), Some(ReportsFolded { first_op: 1, last_op: 1 }));
    let again = FleetChange { reports_folded: Some(folded), ..FleetChange::default() };
    assert!(next.commit(again).is_none(), "the same ranges again are no news");
}

/// Once the book refuses a session's start for want of room, the sums lack a dispatch its
/// replica made: the session's range is published no more, so the replica counts its own
/// dispatches beside the sums rather than trusting them to hold it. Other sessions keep theirs.
#[test]
fn a_session_whose_start_was_refused_for_room_publishes_no_range() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    book.report(2, numbered(1, 1, vec![started(1, 0, 16)]), t0, &state);
    let fits = (0..MAX_DISPATCHES_PER_REPLICA as u64).map(|id| started(id, 0, 16)).collect();
    book.report(1, numbered(1, 5, fits), t0, &state);
    let folded = book.take_change(t0).reports_folded.expect("published with the sums");
    assert_eq!(folded.get(&1), Some(&ReportsFolded { first_op: 1, last_op: 5 }));
    let one_more = started(MAX_DISPATCHES_PER_REPLICA as u64, 0, 16);
    book.report(1, numbered(6, 6, vec![one_more]), t0, &state);
    assert_eq!(book.refused.of(Refusal::ReplicaFull), 1);
    book.report(1, numbered(7, 7, vec![]), t0, &state);
    book.report(2, numbered(2, 2, vec![started(2, 0, 16)]), t0, &state);
    let folded = book.take_change(t0).reports_folded.expect("published with the sums");
    assert_eq!(folded.get(&1), None, "the sums lack one of its dispatches: no range");
    assert_eq!(folded.get(&2), Some(&ReportsFolded { first_op: 1, last_op: 2 }));
    book.replica_gone(1, t0);
    assert!(book.lossy.is_empty(), "forgotten with its session");
}

#[test]
fn a_dispatch_no_request_could_be_is_refused_and_leaves_the_others_sums_whole() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    book.report(1, report(vec![started(1, 0, 160)], vec![]), t0, &state);
    let absurd = [
        pb::DispatchStarted { decode_blocks: u64::MAX, ..started(1, 0, 16) },
        pb::DispatchStarted { prefill_tokens: MAX_REPORTED_PREFILL_TOKENS + 1, ..started(2, 0, 16) },
    ];
    book.report(2, report(absurd.to_vec(), vec![]), t0, &state);
    assert_eq!((book.refused.of(Refusal::Implausible), book.refused.total()), (2, 2));
    book.report(2, report(vec![], vec![1, 2]), t0, &state);
    let change = book.take_change(t0);
    assert_eq!(sums(&change), [(0, 160, 10, 1, None)], "the first replica's dispatch is still counted whole");
}

#[test]
fn a_dispatch_counts_at_most_what_one_request_can_hold_on_its_rank() {
    let capacity = Capacity { total_kv_blocks: Some(100), context_length: Some(4096), ..Capacity::default() };
    let worker = Worker { capacity, ..Worker::clone(&decode_worker(0)) };
    let state = FleetState::new(1, Arc::new(DataPlaneConfig::default()));
    let Some((state, _)) = state.commit(FleetChange { upsert: vec![Arc::new(worker)], ..FleetChange::default() })
    else {
        panic!("upsert is a change")
    };
    let mut book = Book::default();
    let t0 = Instant::now();
    let whole = pb::DispatchStarted { prefill_tokens: 10_000, decode_blocks: 500, ..started(1, 0, 0) };
    book.report(1, report(vec![whole, started(2, 0, 160)], vec![]), t0, &state);
    let change = book.take_change(t0);
    assert_eq!(sums(&change), [(0, 4096 + 160, 100 + 10, 2, None)], "the first at most a context and the whole cache");
    book.report(1, report(vec![], vec![1]), t0, &state);
    assert_eq!(sums(&book.take_change(t0)), [(0, 160, 10, 1, None)], "and its end takes away what it added");
}

/// A dispatch of `hashes.len()` full blocks and a partial one, its chain reported.
fn chained(id: u64, hashes: &[u64]) -> pb::DispatchStarted {
    let blocks = hashes.len() as u64 + 1;
    pb::DispatchStarted { block_hashes: hashes.to_vec(), decode_blocks: blocks, ..started(id, 0, 0) }
}

#[test]
fn blocks_dispatches_share_count_once_across_replicas_until_the_last_holder_ends() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    // Two users of one 4-block system prompt, through two replicas.
    book.report(1, report(vec![chained(1, &[1, 2, 3, 4, 10])], vec![]), t0, &state);
    book.report(2, report(vec![chained(1, &[1, 2, 3, 4, 20])], vec![]), t0, &state);
    assert_eq!(sums(&book.take_change(t0)), [(0, 0, 6 + 2, 2, None)], "the shared prompt counts once");
    book.report(1, report(vec![], vec![1]), t0, &state);
    assert_eq!(sums(&book.take_change(t0)), [(0, 0, 6, 1, None)], "held while the other user's request runs");
    // A sample showing what the worker holds: none of it is foreign.
    let shown = sampled(&state, 0, 6, t0 + Duration::from_millis(1));
    book.expire(&shown, t0 + Duration::from_millis(1));
    assert_eq!(sums(&book.take_change(t0)), [(0, 0, 6, 1, Some(0))]);
    let later = t0 + Duration::from_millis(2);
    book.report(2, report(vec![], vec![1]), later, &state);
    assert_eq!(sums(&book.take_change(later)), [(0, 0, 0, 0, Some(0))]);
    assert_eq!(book.held_hashes, 0, "every hash is released with its dispatch");
}

#[test]
fn a_prefill_leg_holds_no_hashes_and_the_books_hashes_are_bounded() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    let prefill_leg = pb::DispatchStarted { decode_blocks: 0, ..chained(1, &[1, 2, 3]) };
    book.report(1, report(vec![prefill_leg], vec![]), t0, &state);
    assert_eq!(book.held_hashes, 0);
    assert_eq!(sums(&book.take_change(t0)), [(0, 0, 0, 1, None)]);

    book.held_hashes = MAX_ACTIVE_BLOCK_HASHES - 1;
    book.report(1, report(vec![chained(2, &[1, 2]), chained(3, &[1, 2])], vec![]), t0, &state);
    assert_eq!(book.held_hashes, MAX_ACTIVE_BLOCK_HASHES - 1, "past the bound, chains are not held…");
    assert_eq!(book.chains_dropped, 2, "…are counted…");
    assert_eq!(sums(&book.take_change(t0)), [(0, 0, 6, 3, None)], "…and their blocks count whole");
}

/// A decode worker reached by hand-over gets a new request one prefill after it is pinned; the
/// dispatches that will have ended by then are published apart, once the rank's decode and
/// first-token times are known.
#[test]
fn dispatches_that_have_decoded_about_as_long_as_the_rank_takes_are_published_as_ending() {
    let state = state_with(0);
    let mut book = Book::default();
    let ms = Duration::from_millis;
    let t0 = Instant::now();
    // The rank's sums after a publish check at `at`.
    let ending = |book: &mut Book, at: Instant| -> Option<u64> {
        book.expire(&state, at);
        book.take_change(at);
        book.ranks.get(&book_key(0)).map(|r| r.backlog().ending_decode_blocks)
    };
    // The first request teaches the rank: 100 ms to its first token, then 400 ms of decode.
    book.report(1, report(vec![started(1, 0, 1600)], vec![]), t0, &state);
    book.report(1, first_token(1), t0 + ms(100), &state);
    assert_eq!(ending(&mut book, t0 + ms(480)), Some(0), "nothing is known of the decode time yet");
    book.report(1, report(vec![], vec![1]), t0 + ms(500), &state);
    // The second one is expected to end 400 ms after its first token. A request pinned now
    // arrives after its prefill, about half of the 100 ms to a first token: from 350 ms on.
    book.report(1, report(vec![started(2, 0, 1600)], vec![]), t0 + ms(500), &state);
    book.report(1, first_token(2), t0 + ms(600), &state);
    assert_eq!(ending(&mut book, t0 + ms(900)), Some(0));
    book.expire(&state, t0 + ms(950));
    let published = sums(&book.take_change(t0 + ms(950)));
    let ending_now = book.ranks.get(&book_key(0)).map(|r| r.backlog().ending_decode_blocks);
    assert_eq!(ending_now, Some(100), "decoding for 350 ms");
    assert_eq!(published, [(0, 0, 100, 1, None)], "published with time alone; the blocks are still in flight");
    book.report(1, report(vec![], vec![2]), t0 + ms(990), &state);
    assert_eq!(ending(&mut book, t0 + ms(991)), Some(0), "an end takes it out of both");
}

/// A request sent to a rank waits for the rest of the prefill under way, not all of it: the
/// oldest prefill's tokens are published as done in eighths of the time a prefill alone takes
/// there, from its dispatch or the previous first token, whichever is later.
#[test]
fn the_prefill_under_way_is_published_as_done_in_eighths_of_a_prefill_alone() {
    let state = state_with(0);
    let mut book = Book::default();
    let ms = Duration::from_millis;
    let t0 = Instant::now();
    book.report(1, report(vec![started(1, 0, 1600)], vec![]), t0, &state);
    assert_eq!(prefill_sums(&mut book, &state, t0 + ms(79)), Some((1600, 0)), "no prefill alone measured yet");
    // Dispatched while 1 was prefilling: its time to first token is not a prefill's alone.
    book.report(1, report(vec![started(2, 0, 800)], vec![]), t0 + ms(40), &state);
    book.report(1, first_token(1), t0 + ms(80), &state);
    assert_eq!(prefill_sums(&mut book, &state, t0 + ms(80)), Some((800, 0)), "2 began prefilling just now");
    assert_eq!(prefill_sums(&mut book, &state, t0 + ms(119)), Some((800, 300)), "39 of 80 ms: 3 eighths");
    book.report(1, first_token(2), t0 + ms(200), &state);
    // Only 1 was measured alone (80 ms); 2's 160 ms would have halved every later credit.
    book.report(1, report(vec![started(3, 0, 1600), started(4, 0, 1600)], vec![]), t0 + ms(300), &state);
    assert_eq!(prefill_sums(&mut book, &state, t0 + ms(320)), Some((3200, 400)), "the oldest alone progresses");
    assert_eq!(
        prefill_sums(&mut book, &state, t0 + ms(500)),
        Some((3200, 1400)),
        "late is never done: 7 eighths at most"
    );
    book.report(1, first_token(3), t0 + ms(510), &state);
    assert_eq!(prefill_sums(&mut book, &state, t0 + ms(510)), Some((1600, 0)), "4 waited for 3 and begins now");
}

/// A buffered answer shows the replica no first token: its prompt is taken as prefilled once
/// the rank's expected prefill time for it has passed, the next prompt beginning then, and
/// after the seed's 30 seconds on a rank that has learned no prefill time. Those estimates
/// teach the rank no decode time.
#[test]
fn a_buffered_answers_prompt_is_prefilled_when_the_ranks_prefills_say_so() {
    let state = state_with(0);
    let mut book = Book::default();
    let ms = Duration::from_millis;
    let t0 = Instant::now();
    let buffered = |id, tokens| pb::DispatchStarted { buffered: true, ..started(id, 0, tokens) };
    book.report(1, report(vec![buffered(1, 1600)], vec![]), t0, &state);
    let almost = t0 + DISPATCH_MAX_AGE - ms(1);
    assert_eq!(prefill_sums(&mut book, &state, almost), Some((1600, 0)), "no prefill time learned yet");
    assert_eq!(prefill_sums(&mut book, &state, t0 + DISPATCH_MAX_AGE), Some((0, 0)), "the seed's bound");

    // A streamed prompt alone teaches the rank 80 ms a prefill.
    let t1 = t0 + DISPATCH_MAX_AGE + ms(1000);
    book.report(1, report(vec![started(2, 0, 1600)], vec![]), t1, &state);
    book.report(1, first_token(2), t1 + ms(80), &state);
    book.report(1, report(vec![buffered(3, 1600), buffered(4, 1600)], vec![]), t1 + ms(100), &state);
    assert_eq!(prefill_sums(&mut book, &state, t1 + ms(179)), Some((3200, 1400)), "3 is seven eighths through");
    assert_eq!(prefill_sums(&mut book, &state, t1 + ms(180)), Some((1600, 0)), "3 is done and 4 begins");
    assert_eq!(prefill_sums(&mut book, &state, t1 + ms(300)), Some((0, 0)), "4 was done at 260 ms");
    // A streamed prompt behind a buffered one waits for it as for any other.
    book.report(1, report(vec![buffered(5, 1600), started(6, 0, 800)], vec![]), t1 + ms(400), &state);
    assert_eq!(prefill_sums(&mut book, &state, t1 + ms(480)), Some((800, 0)), "6 begins when 5 is taken as done");
    assert_eq!(
        prefill_sums(&mut book, &state, t1 + ms(600)),
        Some((800, 700)),
        "and is late, never done, without its first token"
    );
    book.report(1, first_token(6), t1 + ms(700), &state);
    book.report(1, report(vec![buffered(7, 1600), buffered(8, 1600)], vec![]), t1 + ms(1000), &state);
    assert_eq!(prefill_sums(&mut book, &state, t1 + ms(1170)), Some((0, 0)), "both done by a tick that came late");

    book.report(1, report(vec![], vec![1, 3, 4, 5, 7, 8]), t1 + ms(1200), &state);
    let decode = |book: &Book| book.ranks.get(&book_key(0)).and_then(|r| r.timing.decode);
    assert_eq!(decode(&book), None, "an estimated first token is no measurement");
    book.report(1, report(vec![], vec![2]), t1 + ms(1200), &state);
    assert_eq!(decode(&book), Some(ms(1120)), "a reported one is");
}

/// The rank prefills in order, so a first token reported for a later dispatch says the buffered
/// prompts before it are done; a replayed buffered dispatch began at its own dispatch, not
/// behind the prompts estimated since; a leg with no prompt (a pair's decode leg) has nothing
/// to estimate.
#[test]
fn buffered_prompts_end_with_a_later_first_token_and_replays_are_not_queued_anew() {
    let state = state_with(0);
    let mut book = Book::default();
    let ms = Duration::from_millis;
    let t0 = Instant::now();
    let buffered = |id, tokens| pb::DispatchStarted { buffered: true, ..started(id, 0, tokens) };
    // No prefill time learned: only the later first token can say 1 is done.
    book.report(1, report(vec![buffered(1, 1600), started(2, 0, 800)], vec![]), t0, &state);
    assert_eq!(prefill_sums(&mut book, &state, t0 + ms(40)), Some((2400, 0)));
    book.report(1, first_token(2), t0 + ms(50), &state);
    assert_eq!(prefill_sums(&mut book, &state, t0 + ms(51)), Some((0, 0)), "1 was prefilled before 2");

    // The rank learns 80 ms a prefill; then the replica's stream drops and its next one replays
    // two buffered dispatches made five seconds ago.
    let t1 = t0 + ms(1000);
    book.report(1, report(vec![], vec![1, 2]), t1, &state);
    book.report(1, report(vec![started(3, 0, 1600)], vec![]), t1, &state);
    book.report(1, first_token(3), t1 + ms(80), &state);
    let replayed = |id| pb::DispatchStarted { replayed: true, age_ms: 5000, ..buffered(id, 1600) };
    book.report(1, report(vec![replayed(4), replayed(5)], vec![]), t1 + ms(90), &state);
    assert_eq!(
        prefill_sums(&mut book, &state, t1 + ms(91)),
        Some((0, 0)),
        "done long ago, not queued behind 3's first token"
    );

    // A pair's decode leg brings no prompt: nothing to take as prefilled, even after 30 s.
    let decode_leg = pb::DispatchStarted { buffered: true, decode_blocks: 10, ..started(6, 0, 0) };
    book.report(1, report(vec![decode_leg], vec![]), t1 + ms(100), &state);
    book.expire(&state, t1 + DISPATCH_MAX_AGE + ms(100));
    let answered = book.ranks.get(&book_key(0)).and_then(|r| r.dispatches.get(&(1, 6))).map(|d| d.answered);
    assert_eq!(answered, Some(None), "still only what its replica reports");
}

/// A rank settles whenever it idles; what it learned of its prefill times stays for its next
/// burst, while its worker serves it.
#[test]
fn a_rank_that_settles_keeps_what_it_learned_while_its_worker_serves() {
    let state = state_with(0);
    let mut book = Book::default();
    let ms = Duration::from_millis;
    let t0 = Instant::now();
    book.report(1, report(vec![started(1, 0, 1600)], vec![]), t0, &state);
    book.report(1, first_token(1), t0 + ms(80), &state);
    book.report(1, report(vec![], vec![1]), t0 + ms(100), &state);
    // A sample 250 ms after the end shows the worker as it is.
    let idle = sampled(&state, 0, 0, t0 + ms(400));
    assert_eq!(prefill_sums(&mut book, &idle, t0 + ms(400)), None, "settled");
    book.report(1, report(vec![started(2, 0, 1600)], vec![]), t0 + ms(1000), &idle);
    assert_eq!(prefill_sums(&mut book, &idle, t0 + ms(1040)), Some((1600, 800)), "80 ms a prefill, as learned");
    book.report(1, report(vec![], vec![2]), t0 + ms(1100), &idle);
    let idle = sampled(&idle, 0, 0, t0 + ms(1400));
    assert_eq!(prefill_sums(&mut book, &idle, t0 + ms(1400)), None, "settled again");

    // The worker leaves: what its rank learned goes with it.
    let gone = match idle.commit(FleetChange { remove: vec![rank(0).worker], ..FleetChange::default() }) {
        Some((state, _)) => state,
        None => panic!("a change"),
    };
    book.expire(&gone, t0 + ms(1400) + SWEEP_EVERY);
    assert!(book.learned.is_empty(), "pruned");
}

/// The dispatches the published view holds on `rank(0)`.
fn published_dispatches(publisher: &FleetPublisher) -> Option<u32> {
    publisher.current().view().backlogs().get(&rank(0)).map(|b| b.dispatches)
}

/// Lets the book's task run without letting (paused) time move.
async fn until_published(publisher: &FleetPublisher, dispatches: u32) -> bool {
    for _ in 0..100 {
        if published_dispatches(publisher) == Some(dispatches) {
            return true;
        }
        tokio::task::yield_now().await;
    }
    false
}

/// Counters of a book, registered nowhere.
fn counters() -> BookCounters {
    let counter = |name| IntCounter::new(name, name).expect("counter");
    let refused = prometheus::IntCounterVec::new(prometheus::Opts::new("refused", "refused"), &["reason"]);
    BookCounters {
        refused: refused.expect("counter"),
        chains_dropped: counter("chains"),
        replayed: counter("replayed"),
        restarts: counter("restarts"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_change_after_a_quiet_window_is_published_at_once_and_a_stream_of_them_once_per_window() {
    let publisher = FleetPublisher::starting_at(1, Arc::new(DataPlaneConfig::default()));
    publisher.apply(FleetChange { upsert: vec![decode_worker(1)], ..FleetChange::default() });
    let counters = counters();
    let cancel = CancellationToken::new();
    let book = BacklogBook::spawn(publisher.clone(), ActiveIndex::default(), counters, cancel.clone()).session();

    assert_eq!(book.report(7, report(vec![started(1, 0, 64), started(2, 0, 64)], vec![])).await, Ok(()));
    assert!(until_published(&publisher, 2).await, "the first report is published without time passing");
    // Ticks pass with nothing to publish; the book still holds the dispatches.
    tokio::time::advance(BACKLOG_WINDOW * 2 + BACKLOG_WINDOW / 2).await;
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    assert_eq!(book.report(7, report(vec![], vec![1])).await, Ok(()));
    assert!(
        until_published(&publisher, 1).await,
        "an end after a quiet window reaches the replicas at once, not at the next tick"
    );
    // Right after a publication, the next change waits for the window to pass.
    assert_eq!(book.report(7, report(vec![], vec![2])).await, Ok(()));
    assert!(!until_published(&publisher, 0).await, "published twice within one window");
    tokio::time::advance(BACKLOG_WINDOW).await;
    assert!(until_published(&publisher, 0).await, "the tick publishes what the window held back");
    cancel.cancel();
}

/// A report that moves no sum, held back by the window after a publication, goes out at the
/// tick even when the book holds no rank (and would otherwise sleep until the next command):
/// its replica waits to hear it was folded.
#[tokio::test(start_paused = true)]
async fn a_folded_report_held_back_by_the_window_goes_out_at_the_tick() {
    let publisher = FleetPublisher::starting_at(1, Arc::new(DataPlaneConfig::default()));
    publisher.apply(FleetChange { upsert: vec![decode_worker(1)], ..FleetChange::default() });
    let cancel = CancellationToken::new();
    let book = BacklogBook::spawn(publisher.clone(), ActiveIndex::default(), counters(), cancel.clone()).session();
    let folded = |publisher: &FleetPublisher| publisher.current().reports_folded(7);
    let settle = || async {
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
    };
    // Starts refused (a rank the fleet lacks): folded, no sum moved, no rank held.
    let stranger = |id| {
        let mut start = started(id, 0, 16);
        start.rank = Some((&LoadKey { worker: WorkerKey::new("dynamo", 99), dp_rank: 0 }).into());
        start
    };
    assert_eq!(book.report(7, numbered(1, 1, vec![stranger(1)])).await, Ok(()));
    settle().await;
    assert_eq!(folded(&publisher), Some(ReportsFolded { first_op: 1, last_op: 1 }), "published at once");
    // Within the window: held back, then ticked out.
    assert_eq!(book.report(7, numbered(2, 2, vec![stranger(2)])).await, Ok(()));
    settle().await;
    assert_eq!(folded(&publisher), Some(ReportsFolded { first_op: 1, last_op: 1 }), "held back by the window");
    tokio::time::advance(BACKLOG_WINDOW * 2).await;
    settle().await;
    assert_eq!(folded(&publisher), Some(ReportsFolded { first_op: 1, last_op: 2 }), "out at the tick");
    cancel.cancel();
}

/// A panic in the book's task (a bug) starts the book over instead of freezing every rank's
/// backlog for good: what it published is withdrawn, its blocks in flight forgotten, the
/// restart counted; a session opened before it is refused (its replica reconnects and reports
/// again, replaying its dispatches), and one opened after it is folded as ever.
#[tokio::test(start_paused = true)]
async fn a_panic_in_the_books_task_starts_it_over_empty_and_ends_the_sessions_opened_before() {
    let publisher = FleetPublisher::starting_at(1, Arc::new(DataPlaneConfig::default()));
    publisher.apply(FleetChange { upsert: vec![decode_worker(1)], ..FleetChange::default() });
    let (counters, active, cancel) = (counters(), ActiveIndex::default(), CancellationToken::new());
    let book = BacklogBook::spawn(publisher.clone(), active.clone(), counters.clone(), cancel.clone());
    let before = book.session();
    let chained = pb::DispatchStarted { block_hashes: vec![11, 12, 13, 14], ..started(1, 0, 64) };
    assert_eq!(before.report(7, report(vec![chained, started(2, 0, 64)], vec![])).await, Ok(()));
    assert!(until_published(&publisher, 2).await);
    assert_eq!(active.ranks(), 1);

    book.fault().await;
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    assert_eq!(published_dispatches(&publisher), None, "the backlogs the book published are withdrawn");
    assert_eq!(active.ranks(), 0, "and its blocks in flight");
    assert_eq!(counters.restarts.get(), 1);
    assert_eq!(
        before.report(7, report(vec![], vec![1])).await,
        Err(NotQueued::Restarted),
        "a session the new book knows nothing of is ended"
    );

    let after = book.session();
    let replayed = pb::DispatchStarted { replayed: true, ..started(2, 0, 64) };
    assert_eq!(after.report(8, report(vec![replayed], vec![])).await, Ok(()));
    tokio::time::advance(BACKLOG_WINDOW).await;
    assert!(until_published(&publisher, 1).await, "the new book folds the replica's replay");
    cancel.cancel();
}

/// A fault that comes back at once (a report whose content trips it, replayed at every
/// reconnect) does not make restarts a loop ending every stream: past the few a window allows,
/// the book gives up, leaves the streams open and drops every report unread.
#[tokio::test(start_paused = true)]
async fn a_book_that_keeps_panicking_gives_up_and_leaves_the_streams_open() {
    let publisher = FleetPublisher::starting_at(1, Arc::new(DataPlaneConfig::default()));
    publisher.apply(FleetChange { upsert: vec![decode_worker(1)], ..FleetChange::default() });
    let (counters, cancel) = (counters(), CancellationToken::new());
    let book = BacklogBook::spawn(publisher.clone(), ActiveIndex::default(), counters.clone(), cancel.clone());
    let settle = || async {
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
    };
    for _ in 0..task::MAX_RESTARTS {
        book.fault().await;
        settle().await;
    }
    let session = book.session();
    assert_eq!(session.report(7, report(vec![started(1, 0, 64)], vec![])).await, Ok(()));
    assert!(until_published(&publisher, 1).await, "restarted: the book still folds");
    book.fault().await;
    settle().await;
    assert_eq!(counters.restarts.get(), task::MAX_RESTARTS as u64 + 1);
    assert_eq!(published_dispatches(&publisher), None, "what it had published is withdrawn");
    assert_eq!(session.report(7, report(vec![started(2, 0, 64)], vec![])).await, Ok(()), "the stream is left open");
    tokio::time::advance(BACKLOG_WINDOW).await;
    settle().await;
    assert_eq!(published_dispatches(&publisher), None, "reports are dropped unread");
    cancel.cancel();
}

#[test]
fn a_worker_removed_and_added_again_gets_its_backlog_published_anew() {
    let commit = |state: &FleetState, change: FleetChange| match state.commit(change) {
        Some((state, _)) => state,
        None => panic!("a change"),
    };
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    book.report(1, report(vec![started(1, 0, 160)], vec![]), t0, &state);
    let published = book.take_change(t0);
    assert_eq!(sums(&published), [(0, 160, 10, 1, None)]);
    let state = commit(&state, published);
    // A reload that resets the registry: the worker goes, and comes back unchanged.
    let gone = commit(&state, FleetChange { remove: vec![rank(0).worker], ..FleetChange::default() });
    book.expire(&gone, t0);
    assert!(book.take_change(t0).backlogs.is_empty(), "nothing to publish for a worker the fleet lacks");
    let back = commit(&gone, FleetChange { upsert: vec![decode_worker(0)], ..FleetChange::default() });
    assert!(back.view().backlogs().is_empty(), "the view dropped the departed worker's backlog");
    book.expire(&back, t0);
    assert_eq!(sums(&book.take_change(t0)), [(0, 160, 10, 1, None)], "the unchanged sum goes out again");
}

/// Starts `count` dispatches for `replica`, numbered from `first`, in reports of the most a
/// report may start.
fn fill(book: &mut Book, state: &FleetState, replica: u64, first: u64, count: usize) {
    let ids: Vec<u64> = (first..first + count as u64).collect();
    for batch in ids.chunks(continuum_proto::MAX_REPORT_STARTED) {
        book.report(
            replica,
            report(batch.iter().map(|id| started(*id, 0, 16)).collect(), vec![]),
            Instant::now(),
            state,
        );
    }
}

#[test]
fn the_book_holds_a_bounded_number_of_dispatches_and_replicas_filling_it_cannot_lock_the_others_out() {
    let state = state_with(0);
    let mut book = Book::default();
    // Replicas fill the book, each to half its own bound, until the book's bound is reached.
    let each = MAX_DISPATCHES_PER_REPLICA / 2;
    let hogs = (MAX_DISPATCHES / each) as u64;
    for replica in 0..hogs {
        fill(&mut book, &state, replica, 0, each);
    }
    assert_eq!((book.held, book.refused.total()), (MAX_DISPATCHES, 0));
    // Past it, they may start no more, within their own bounds as they are: each holds an
    // equal share already.
    book.report(0, report(vec![started(u64::MAX, 0, 16)], vec![]), Instant::now(), &state);
    assert_eq!((book.held, book.refused.of(Refusal::BookFull)), (MAX_DISPATCHES, 1));
    // A replica that holds less may, up to its share among them all.
    let share = MAX_DISPATCHES / (hogs as usize + 1);
    fill(&mut book, &state, hogs, 0, share + 2);
    assert_eq!(book.where_is[&hogs].len(), share);
    assert_eq!((book.held, book.refused.of(Refusal::BookFull)), (MAX_DISPATCHES + share, 3));
    // An end makes room for its replica again.
    book.report(hogs, report(vec![], vec![0]), Instant::now(), &state);
    book.report(hogs, report(vec![started(share as u64 + 9, 0, 16)], vec![]), Instant::now(), &state);
    assert_eq!((book.held, book.refused.of(Refusal::BookFull)), (MAX_DISPATCHES + share, 3));
    // Shares shrink as replicas come, but the book holds twice its bound at most.
    let mut replica = hogs + 1;
    while book.held < 2 * MAX_DISPATCHES {
        let held = book.held;
        fill(&mut book, &state, replica, 0, 4096);
        assert!(book.held > held, "a newcomer below its share takes room");
        replica += 1;
    }
    let refused = book.refused.of(Refusal::BookFull);
    fill(&mut book, &state, replica, 0, 1);
    assert_eq!((book.held, book.refused.of(Refusal::BookFull)), (2 * MAX_DISPATCHES, refused + 1));
    // A replica's dispatches go with it, and only its own are looked at.
    book.replica_gone(0, Instant::now());
    while book.forget_departed(Instant::now()) {}
    assert_eq!(book.held, 2 * MAX_DISPATCHES - each);
    assert!(!book.where_is.contains_key(&0));
}

/// A session that ended holding many dispatches is forgotten a chunk at a time, so that the
/// book's other work waits for a chunk, not for all of them; every one goes in the end, and
/// so does the session, its dispatches that ended meanwhile included.
#[test]
fn an_ended_session_is_forgotten_a_chunk_at_a_time() {
    let state = state_with(0);
    let mut book = Book::default();
    let now = Instant::now();
    fill(&mut book, &state, 1, 0, 3 * DEPARTURE_CHUNK + 10);
    fill(&mut book, &state, 2, 0, 3);
    book.replica_gone(1, now);
    assert_eq!(book.held, 2 * DEPARTURE_CHUNK + 10 + 3, "one chunk forgotten at once");
    assert!(book.departing());
    // Said again while it departs: another chunk goes, and its second turn finds nothing.
    book.replica_gone(1, now);
    assert_eq!(book.held, DEPARTURE_CHUNK + 10 + 3);
    // One of the rest ends meanwhile (a report queued before the session's end was seen).
    let still_held = *book.where_is[&1].keys().next().expect("a dispatch left");
    book.report(1, report(vec![], vec![still_held]), now, &state);
    assert!(book.forget_departed(now), "a chunk at a time");
    assert_eq!(book.held, 10 - 1 + 3);
    while book.forget_departed(now) {}
    assert_eq!((book.held, book.where_is.contains_key(&1)), (3, false));
    let rank = book.ranks.get(&book_key(0)).map(|r| r.dispatches.len());
    assert_eq!(rank, Some(3), "the other session's dispatches stay");
    assert!(!book.departing());
}

/// A replay (a reconnected replica's dispatches, under its new session) is folded only once
/// every session that ended is forgotten: the same dispatches never count twice.
#[test]
fn a_replay_waits_for_no_departure_to_be_forgotten_first() {
    let state = state_with(0);
    let mut book = Book::default();
    let now = Instant::now();
    fill(&mut book, &state, 1, 0, 2 * DEPARTURE_CHUNK);
    book.replica_gone(1, now);
    assert!(book.departing());
    let replayed = pb::DispatchStarted { replayed: true, ..started(0, 0, 16) };
    book.report(2, report(vec![replayed], vec![]), now, &state);
    assert!(!book.departing());
    assert_eq!(book.held, 1, "the old session's dispatches gone before its replay was folded");
}

/// A rank that held a flood of dispatches and now holds one keeps no room for the flood: the
/// book's bound on dispatches held would not bound its memory otherwise.
#[test]
fn a_rank_left_with_one_dispatch_after_a_flood_gives_its_room_back() {
    let state = state_with(0);
    let mut book = Book::default();
    fill(&mut book, &state, 1, 0, 10_000);
    let room = |book: &Book| book.ranks.get(&book_key(0)).map_or(0, |rank| rank.dispatches.capacity());
    let flooded = room(&book);
    let ends: Vec<u64> = (1..10_000).collect();
    for batch in ends.chunks(continuum_proto::MAX_REPORT_ENDS) {
        book.report(1, report(vec![], batch.to_vec()), Instant::now(), &state);
    }
    assert_eq!(book.held, 1);
    assert!(flooded >= 10_000 && room(&book) <= 2048, "room for {flooded}, then for {}", room(&book));
}

#[test]
fn a_cut_chain_gives_its_memory_back() {
    let state = state_with(0);
    let mut book = Book::default();
    let mut long = started(1, 0, 16);
    long.block_hashes = (0..4096).collect();
    // One block to hold: the rest of the chain is cut, and its room given back.
    book.report(1, report(vec![long], vec![]), Instant::now(), &state);
    let held: usize =
        book.ranks.values().flat_map(|rank| rank.dispatches.values()).map(|d| d.block_hashes.capacity()).sum();
    assert!(held < 64, "a one-block dispatch keeps room for {held} hashes");
}

#[tokio::test]
async fn reports_waiting_for_the_book_are_bounded_in_bytes_not_only_in_number() {
    let publisher = FleetPublisher::starting_at(1, Arc::new(DataPlaneConfig::default()));
    let counters = counters();
    let cancel = CancellationToken::new();
    let book = BacklogBook::spawn(publisher, ActiveIndex::default(), counters, cancel.clone());
    // The book's task does not run while this one does not yield: every report waits.
    let ends = continuum_proto::MAX_REPORT_ENDS as u64;
    let heavy = || report(vec![], (0..ends).collect());
    let bytes = report_bytes(&heavy());
    let sessions: Vec<_> = (0..SESSION_SHARE).map(|_| book.session()).collect();
    let share = MAX_QUEUED_REPORT_BYTES / SESSION_SHARE / bytes;
    for (replica, session) in (1..).zip(&sessions) {
        let accepted = (0..COMMAND_QUEUE).take_while(|_| queued_now(session.report(replica, heavy()))).count();
        assert!(accepted < COMMAND_QUEUE / SESSION_SHARE, "the byte bound is reached first");
        assert_eq!(accepted, share, "as many as fit in the session's share of {MAX_QUEUED_REPORT_BYTES} bytes");
    }
    // A fifth session's share has room; the queue's own bound does not: past what it has left,
    // the fifth's report waits for the book.
    let left = MAX_QUEUED_REPORT_BYTES - SESSION_SHARE * share * bytes;
    let fifth = book.session();
    let fitting = (0..COMMAND_QUEUE).take_while(|_| queued_now(fifth.report(9, heavy()))).count();
    assert_eq!(fitting, left / bytes, "what the whole queue has left, not the fifth's share");
    assert_eq!(fifth.report(9, heavy()).now_or_never(), None, "the next one waits for room");
    // Once the book has taken them, there is room again.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(sessions[0].report(1, heavy()).await, Ok(()));
    cancel.cancel();
}

/// One replica flooding the book fills its own share of the queue and is refused there; the
/// others' reports still find room. Every session flooding fills the whole queue.
#[tokio::test]
async fn a_flooding_session_leaves_room_in_the_queue_for_the_others() {
    let publisher = FleetPublisher::starting_at(1, Arc::new(DataPlaneConfig::default()));
    let cancel = CancellationToken::new();
    let book = BacklogBook::spawn(publisher, ActiveIndex::default(), counters(), cancel.clone());
    let small = || report(vec![], vec![1]);
    let flooding = book.session();
    let accepted = (0..COMMAND_QUEUE).take_while(|_| queued_now(flooding.report(1, small()))).count();
    assert_eq!(accepted, COMMAND_QUEUE / SESSION_SHARE, "a share of the queue's reports");
    assert_eq!(flooding.report(1, small()).now_or_never(), Some(Err(NotQueued::Full)), "refused past it");
    let honest = book.session();
    assert_eq!(honest.report(2, small()).now_or_never(), Some(Ok(())), "another session's report finds room");
    let others: Vec<_> = (1..SESSION_SHARE).map(|_| book.session()).collect();
    let held: usize =
        others.iter().map(|s| (0..COMMAND_QUEUE).take_while(|_| queued_now(s.report(3, small()))).count()).sum();
    assert_eq!(accepted + 1 + held, COMMAND_QUEUE, "together, the sessions fill the whole queue");
    // A session within its share waits for room in a full one, and finds it as the book folds.
    assert_eq!(book.session().report(4, small()).await, Ok(()), "room made by the book");
    cancel.cancel();
}

/// A session that ended leaves its queued reports to be dropped unread: its replica, refused
/// for flooding, cannot reconnect and flood again while the book still works through what it
/// left behind, with every other replica's reports waiting behind that.
#[tokio::test]
async fn the_reports_of_a_session_that_ended_are_dropped_unread() {
    let publisher = FleetPublisher::starting_at(1, Arc::new(DataPlaneConfig::default()));
    let cancel = CancellationToken::new();
    let counters = counters();
    let book = BacklogBook::spawn(publisher, ActiveIndex::default(), counters.clone(), cancel.clone());
    // Each starts a dispatch on a rank this fleet does not have: folded, it is counted refused.
    let unknown = || report(vec![started(7, 0, 16)], vec![]);
    let flooding = book.session();
    let queued = (0..COMMAND_QUEUE).take_while(|_| queued_now(flooding.report(1, unknown()))).count();
    assert_eq!(queued, COMMAND_QUEUE / SESSION_SHARE);
    drop(flooding);
    let honest = book.session();
    assert_eq!(honest.report(2, unknown()).now_or_never(), Some(Ok(())), "room for another session");
    let folded = || counters.refused.with_label_values(&[Refusal::UnknownRank.as_str()]).get();
    tokio::time::timeout(Duration::from_secs(5), async {
        while folded() == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the honest report is folded");
    assert_eq!(folded(), 1, "only the live session's report was folded");
    cancel.cancel();
}

/// A book kept busy by a queue that never empties (the biased select always finds a report
/// first, so its tick does not run) still counts each refusal as it makes it: the counters
/// are an operator's view of an overloaded book, exactly when they matter.
#[tokio::test(start_paused = true)]
async fn refusals_are_counted_while_queued_reports_keep_the_book_busy() {
    let publisher = FleetPublisher::starting_at(1, Arc::new(DataPlaneConfig::default()));
    let (counters, cancel) = (counters(), CancellationToken::new());
    let book = BacklogBook::spawn(publisher, ActiveIndex::default(), counters.clone(), cancel.clone());
    let sessions: Vec<SessionReports> = (0..SESSION_SHARE).map(|_| book.session()).collect();
    let mut queued = 0;
    for (replica, session) in (1..).zip(&sessions) {
        // A dispatch on a rank this fleet does not have: folded, it is counted refused.
        queued += (0..COMMAND_QUEUE)
            .take_while(|_| queued_now(session.report(replica, report(vec![started(7, 0, 16)], vec![]))))
            .count();
    }
    tokio::task::yield_now().await;
    let counted = counters.refused.with_label_values(&[Refusal::UnknownRank.as_str()]).get();
    assert!(counted > 0 && (counted as usize) < queued, "{counted} of {queued} counted while the rest wait");
    cancel.cancel();
}

#[test]
fn a_report_is_charged_for_the_namespaces_its_replica_wrote() {
    let mut long = started(1, 0, 16);
    let small = report_bytes(&report(vec![long.clone()], vec![]));
    if let Some(worker) = long.rank.as_mut().and_then(|rank| rank.worker.as_mut()) {
        worker.namespace = "n".repeat(1 << 20);
    }
    let large = report_bytes(&report(vec![long], vec![]));
    assert!(large >= small + (1 << 20) - 64, "{small} then {large} bytes");
}

/// A stream that ends, or an end that never comes, is no request finishing: the dispatches
/// it drops teach no decode time and leave no ended blocks a sample might still show.
#[test]
fn dispatches_dropped_without_their_end_are_no_measurement() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    book.report(1, report(vec![started(1, 0, 16)], vec![]), t0, &state);
    book.report(1, pb::DispatchReport { prefilled: vec![1], ..Default::default() }, t0, &state);
    book.report(2, report(vec![started(1, 0, 16)], vec![]), t0, &state);
    book.report(2, pb::DispatchReport { prefilled: vec![1], ..Default::default() }, t0, &state);
    book.replica_gone(1, t0);
    book.expire(&state, t0 + IN_FLIGHT_MAX_AGE);
    let rank = book.ranks.get(&book_key(0)).expect("the rank");
    assert!(rank.dispatches.is_empty());
    assert_eq!((rank.timing.decode, rank.ended.len()), (None, 0));

    // Nor does the rank settle at once, losing what it learned, before a replay can come.
    let mut book = Book::default();
    book.report(1, report(vec![started(1, 0, 16)], vec![]), t0, &state);
    book.report(1, pb::DispatchReport { prefilled: vec![1], ..Default::default() }, t0, &state);
    book.report(1, report(vec![], vec![1]), t0 + Duration::from_secs(1), &state);
    let learned = book.ranks.get(&book_key(0)).and_then(|r| r.timing.decode);
    assert!(learned.is_some());
    let later = t0 + 2 * DISPATCH_MAX_AGE;
    book.report(1, report(vec![started(2, 0, 16)], vec![]), later, &state);
    book.replica_gone(1, later);
    book.expire(&state, later);
    book.take_change(later);
    assert_eq!(book.ranks.get(&book_key(0)).and_then(|r| r.timing.decode), learned, "still held");
}

/// A report folds its operations in the replica's order: a start finds its rank as the replica
/// left it, after the first tokens and ends it performed before the start.
#[test]
fn a_start_sees_the_first_tokens_and_ends_reported_before_it() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    let alone =
        |book: &Book, id: u64| book.ranks.get(&book_key(0)).and_then(|r| r.dispatches.get(&(1, id))).map(|d| d.alone);
    book.report(1, report(vec![started(1, 0, 1600)], vec![]), t0, &state);
    // 1's first token, then 2 started: 2 prefills alone (its time to first token teaches).
    let after_first_token = pb::DispatchStarted { after_prefilled: 1, ..started(2, 0, 800) };
    let report_two = pb::DispatchReport { started: vec![after_first_token], prefilled: vec![1], ..Default::default() };
    book.report(1, report_two, t0 + Duration::from_millis(80), &state);
    assert_eq!(alone(&book, 2), Some(true));
    // 3 started, then 2's first token: 3 waited behind 2's prefill.
    let report_three =
        pb::DispatchReport { started: vec![started(3, 0, 800)], prefilled: vec![2], ..Default::default() };
    book.report(1, report_three, t0 + Duration::from_millis(160), &state);
    assert_eq!(alone(&book, 3), Some(false));

    // A replica at its bound that ends one dispatch and then starts another has room for it.
    let mut book = Book::default();
    let full = (0..MAX_DISPATCHES_PER_REPLICA as u64).map(|id| started(id, 0, 16)).collect();
    book.report(1, report(full, vec![]), t0, &state);
    let after_end = pb::DispatchStarted { after_ended: 1, ..started(u64::MAX, 0, 16) };
    book.report(1, report(vec![after_end], vec![0]), t0, &state);
    assert_eq!((book.refused.total(), book.held), (0, MAX_DISPATCHES_PER_REPLICA));
}

mod counts {
    //! The book's running counts against what they count, after any sequence of reports, ticks
    //! and departures.

    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Op {
        Start { replica: u64, id: u64, dp_rank: u32, tokens: u64, buffered: bool, replayed: bool, may_stall: bool },
        Prefilled { replica: u64, id: u64 },
        End { replica: u64, id: u64 },
        Tick { millis: u64 },
        Gone { replica: u64 },
    }

    fn op() -> impl Strategy<Value = Op> {
        let replica = 0..3u64;
        let id = 0..12u64;
        prop_oneof![
            4 => (replica.clone(), id.clone(), 0..2u32, 0..3000u64, any::<bool>(), any::<bool>(), any::<bool>()).prop_map(
                |(replica, id, dp_rank, tokens, buffered, replayed, may_stall)| Op::Start { replica, id, dp_rank, tokens, buffered, replayed, may_stall }
            ),
            2 => (replica.clone(), id.clone()).prop_map(|(replica, id)| Op::Prefilled { replica, id }),
            2 => (replica.clone(), id).prop_map(|(replica, id)| Op::End { replica, id }),
            2 => (0..40_000u64).prop_map(|millis| Op::Tick { millis }),
            1 => replica.prop_map(|replica| Op::Gone { replica }),
        ]
    }

    fn check(book: &Book) -> Result<(), TestCaseError> {
        let mut in_ranks = 0;
        for rank in book.ranks.values() {
            let queued = |keep: fn(&Dispatch) -> bool| -> std::collections::BTreeSet<rank::Queued> {
                rank.dispatches.iter().filter(|(_, d)| keep(d)).map(|(id, d)| (d.at, *id)).collect()
            };
            prop_assert_eq!(&rank.prefill_queue.queued(), &queued(|d| d.prefill_tokens() > 0));
            let tokens: u64 = rank.dispatches.values().map(Dispatch::prefill_tokens).sum();
            prop_assert_eq!(rank.prefill_queue.tokens(), tokens, "the running sum of the queue's tokens");
            prop_assert_eq!(&rank.awaiting_estimate, &queued(Dispatch::awaits_estimate));
            // Stallable: only what may stall, and all of it no first token answered (an estimate
            // answers nothing: a buffered dispatch stays stallable until its end or a sample).
            let may_stall = queued(|d| d.may_stall);
            prop_assert!(rank.stallable.is_subset(&may_stall), "only dispatches that may stall");
            prop_assert!(queued(|d| d.may_stall && d.answered.is_none()).is_subset(&rank.stallable));
            in_ranks += rank.dispatches.len();
        }
        let filed: usize = book.where_is.values().map(|session| session.len()).sum();
        prop_assert_eq!((book.held, filed), (in_ranks, in_ranks));
        for (session, ids) in &book.where_is {
            for (id, key) in ids {
                prop_assert!(book.ranks.get(key).is_some_and(|rank| rank.dispatches.contains_key(&(*session, *id))));
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn the_prefill_queues_hold_exactly_what_they_order(ops in proptest::collection::vec(op(), 1..80)) {
            let state = state_with(2);
            let mut book = Book::default();
            let mut now = Instant::now();
            for op in ops {
                match op {
                    Op::Start { replica, id, dp_rank, tokens, buffered, replayed, may_stall } => {
                        let start = pb::DispatchStarted { buffered, replayed, may_stall, age_ms: tokens, ..started(id, dp_rank, tokens) };
                        book.report(replica, report(vec![start], vec![]), now, &state);
                    }
                    Op::Prefilled { replica, id } => book.report(replica, first_token(id), now, &state),
                    Op::End { replica, id } => book.report(replica, report(vec![], vec![id]), now, &state),
                    Op::Tick { millis } => {
                        now += Duration::from_millis(millis);
                        book.expire(&state, now);
                        book.take_change(now);
                    }
                    Op::Gone { replica } => book.replica_gone(replica, now),
                }
                check(&book)?;
            }
        }
    }
}

/// A rank holding more than [`rank::WALK_BUDGET`] dispatches is walked at its pace: a sample
/// that arrives just after a walk is measured at the next one, windows later, not at once.
#[test]
fn a_flooded_rank_is_walked_at_its_pace() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    let flood = 2 * rank::WALK_BUDGET as u64 + 1;
    book.report(1, report((0..flood).map(|id| started(id, 0, 16)).collect(), vec![]), t0, &state);
    book.expire(&state, t0);
    let received = t0 + Duration::from_millis(1);
    let shown = sampled(&state, 0, 100, received);
    let sampled_at = |book: &Book| book.ranks.get(&book_key(0)).and_then(|rank| rank.sampled_at);
    book.expire(&shown, received);
    assert_ne!(sampled_at(&book), Some(received), "not measured within the rank's pace");
    book.expire(&shown, t0 + 2 * BACKLOG_WINDOW);
    assert_eq!(sampled_at(&book), Some(received), "measured once the pace allows");

    // A rank within the budget is walked at every window.
    let mut book = Book::default();
    book.report(1, report((0..16).map(|id| started(id, 0, 16)).collect(), vec![]), t0, &state);
    book.expire(&state, t0);
    book.expire(&shown, received);
    assert_eq!(sampled_at(&book), Some(received));
}

/// Past [`rank::BOOK_WALK_BUDGET`] dispatches over all its ranks, each within its own budget,
/// the book spreads its walks over windows: a sample every rank received at once is measured
/// over two windows here, not all in one.
#[test]
fn a_full_book_spreads_its_walks_over_windows() {
    const RANKS: u32 = 16;
    let per_rank = (2 * rank::BOOK_WALK_BUDGET / RANKS as usize) as u64;
    assert!(per_rank < rank::WALK_BUDGET as u64, "each rank within its own budget");
    let state = state_with(RANKS);
    let mut book = Book::default();
    let t0 = Instant::now();
    for dp in 0..RANKS {
        let first = u64::from(dp) * per_rank;
        let started = (first..first + per_rank).map(|id| started(id, dp, 16)).collect();
        book.report(1, report(started, vec![]), t0, &state);
    }
    book.expire(&state, t0);
    let received = t0 + Duration::from_millis(1);
    let shown = (0..RANKS).fold(state.clone(), |shown, dp| sampled(&shown, dp, 100, received));
    let measured = |book: &Book| book.ranks.values().filter(|rank| rank.sampled_at == Some(received)).count();
    book.expire(&shown, t0 + BACKLOG_WINDOW);
    let first = measured(&book);
    assert!(first > 0 && first < RANKS as usize, "{first} of {RANKS} ranks walked in one window");
    book.expire(&shown, t0 + 2 * BACKLOG_WINDOW);
    assert_eq!(measured(&book), RANKS as usize, "every rank walked within two windows");

    // Half as much again past the budget: the ranks walked first must not take it at every
    // window, so that those after them are never walked.
    let per_rank = (3 * rank::BOOK_WALK_BUDGET / 2 / RANKS as usize) as u64;
    let mut book = Book::default();
    for dp in 0..RANKS {
        let first = u64::from(dp) * per_rank;
        let started = (first..first + per_rank).map(|id| started(id, dp, 16)).collect();
        book.report(1, report(started, vec![]), t0, &state);
    }
    book.expire(&state, t0);
    for window in 1..=3 {
        book.expire(&shown, t0 + window * BACKLOG_WINDOW);
    }
    assert_eq!(measured(&book), RANKS as usize, "every rank walked within three windows");
}

/// A session whose flood of dispatches ended gives back the room it held for them, as each
/// rank's map does: a replica idle after a burst does not hold megabytes until it disconnects.
#[test]
fn a_session_past_its_flood_gives_its_room_back() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    let flood = 2 * rank::WALK_BUDGET as u64;
    book.report(1, report((0..flood).map(|id| started(id, 0, 16)).collect(), vec![]), t0, &state);
    let room = |book: &Book| book.where_is.get(&1).map_or(0, |session| session.capacity());
    assert!(room(&book) >= flood as usize);
    book.report(1, report(vec![], (0..flood - 1).collect()), t0, &state);
    assert!(room(&book) <= 2048, "{} held for one dispatch", room(&book));
}

/// A replica's stream ends with its dispatch in flight, measured by the rank's last sample as
/// the fleet's own: forgotten, then reported again on the next stream, it weighs on the rank
/// as that sample shows it throughout, neither dropped nor taken off twice.
#[test]
fn a_dispatch_forgotten_and_replayed_keeps_its_sample_share() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    book.report(1, report(vec![started(1, 0, 160)], vec![]), t0, &state);
    // Its 10 blocks and 20 of others'.
    let measured_at = t0 + Duration::from_millis(10);
    let shown = sampled(&state, 0, 30, measured_at);
    let total = |book: &mut Book, at: Instant| {
        book.expire(&shown, at);
        let backlog = book.ranks.get(&book_key(0)).map(|rank| rank.backlog());
        backlog.map(|b| b.decode_blocks + b.foreign_decode_blocks.unwrap_or_default())
    };
    assert_eq!(total(&mut book, measured_at), Some(30));
    let gone = measured_at + Duration::from_millis(10);
    book.replica_gone(1, gone);
    assert_eq!(total(&mut book, gone), Some(30), "still on the worker, as far as the sample says");
    let replay = pb::DispatchStarted { replayed: true, age_ms: 40, ..started(1, 0, 160) };
    let back = gone + Duration::from_millis(10);
    book.report(1, report(vec![replay], vec![]), back, &shown);
    assert_eq!(total(&mut book, back), Some(30), "counted once, as the fleet's again");
}

/// Whether rank 0's published backlog says stalled after a publish check at `at`: what was
/// streamed, not what the rank would say now (a change never marked would not be). A rank
/// that settled published its idle backlog, which never says stalled.
fn stalled(book: &mut Book, state: &FleetState, at: Instant) -> bool {
    book.expire(state, at);
    book.take_change(at);
    book.ranks.get(&book_key(0)).is_some_and(|r| r.published.is_some_and(|published| published.stalled))
}

/// The seed's stall, fleet-wide: a dispatch any replica reported as able to stall its rank,
/// left unanswered (no first token, no sample since) for 5 s, marks the rank stalled for every
/// replica, until a sample, its first token, its end, or 30 s.
#[test]
fn a_dispatch_left_unanswered_stalls_its_rank_for_every_replica_until_an_answer() {
    let t0 = Instant::now();
    let state = sampled(&state_with(0), 0, 3, t0);
    let stallable = |id| pb::DispatchStarted { may_stall: true, ..started(id, 0, 160) };
    let mut book = Book::default();
    // A pair's decode leg (not stallable) never stalls its rank, however long it waits.
    book.report(1, report(vec![started(1, 0, 160)], vec![]), t0 + SAMPLE_LAG * 2, &state);
    assert!(!stalled(&mut book, &state, t0 + SAMPLE_LAG * 2 + STALL_AFTER * 2));

    let sent = t0 + Duration::from_secs(20);
    book.report(2, report(vec![stallable(1)], vec![]), sent, &state);
    assert!(!stalled(&mut book, &state, sent + STALL_AFTER - Duration::from_millis(1)));
    assert!(stalled(&mut book, &state, sent + STALL_AFTER), "5 s unanswered");
    // A sample answers it, and still has once the view drops it (a sequence gap).
    let answered = sampled(&state, 0, 13, sent + STALL_AFTER + Duration::from_millis(10));
    assert!(!stalled(&mut book, &answered, sent + STALL_AFTER + Duration::from_millis(10)));
    let dropped = answered.commit(FleetChange { loads_removed: vec![rank(0)], ..FleetChange::default() });
    let Some((dropped, _)) = dropped else { panic!("dropping a sample is a change") };
    assert!(!stalled(&mut book, &dropped, sent + STALL_AFTER * 2), "answered before it was dropped");

    // Its first token answers it too, and its end; so does a sample received shortly before its
    // report came (the worker may have had the request before the book had its report).
    let later = sent + Duration::from_secs(10);
    book.report(2, report(vec![stallable(2), stallable(3)], vec![]), later, &answered);
    assert!(stalled(&mut book, &answered, later + STALL_AFTER));
    book.report(2, first_token(2), later + STALL_AFTER, &answered);
    assert!(stalled(&mut book, &answered, later + STALL_AFTER), "3 is still unanswered");
    book.report(2, report(vec![], vec![3]), later + STALL_AFTER, &answered);
    assert!(!stalled(&mut book, &answered, later + STALL_AFTER));
    let lagging = later + Duration::from_secs(10);
    let just_before = sampled(&answered, 0, 20, lagging - SAMPLE_LAG / 2);
    book.report(3, report(vec![stallable(1)], vec![]), lagging, &just_before);
    assert!(!stalled(&mut book, &just_before, lagging + STALL_AFTER * 2), "its sample came just before its report");

    // Unanswered past 30 s, a dispatch no longer says anything of its rank.
    let last = lagging + Duration::from_secs(1);
    book.report(3, report(vec![stallable(2)], vec![]), last, &just_before);
    assert!(stalled(&mut book, &just_before, last + STALL_AFTER));
    assert!(!stalled(&mut book, &just_before, last + DISPATCH_MAX_AGE));
}
