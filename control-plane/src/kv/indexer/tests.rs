//! The indexer's rules, driven by real Dynamo 1.6.1 captures where they exist: the agg dp=2
//! worker's publishers and live ranks come from its etcd dump, its events from the captured
//! streams, and the resulting index is checked against a plain replay model.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use anyhow::Context;
use serde_json::Value;

use super::*;
use crate::kv::decode::{KvEventBatch, ResidencyDomain, StorageTier, Stored, StoredBlock};
use crate::kv::fixtures::{self, frames};

/// The agg run's etcd records: its kv-events publishers' mappings and its live ranks.
fn agg_discovery() -> anyhow::Result<(HashMap<u64, PublisherMapping>, LiveRanks)> {
    let text = std::fs::read_to_string(Path::new(fixtures::FIXTURES).join("agg/etcd-dump.jsonl"))?;
    let (mut publishers, mut live) = (HashMap::new(), LiveRanks::new());
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let record: Value = serde_json::from_str(line)?;
        let (etcd_key, value) = (record["key"].as_str().context("key")?, &record["value"]);
        if etcd_key.starts_with("v1/event_sources/") && value["topic"] == "kv-events" {
            let worker = &value["metadata"]["worker"];
            let publisher_id = value["publisher_id"].as_u64().context("publisher_id")?;
            let mapping = PublisherMapping {
                publisher: key(publisher_id),
                worker_id: worker["worker_id"].as_u64().context("worker_id")?,
                dp_rank: Some(u32::try_from(worker["dp_rank"].as_u64().context("dp_rank")?)?),
            };
            publishers.insert(publisher_id, mapping);
        } else if etcd_key.starts_with("v1/mdc/") {
            let rc = &value["card_json"]["runtime_config"];
            let start = u32::try_from(rc["data_parallel_start_rank"].as_u64().context("start")?)?;
            let size = u32::try_from(rc["data_parallel_size"].as_u64().context("size")?)?;
            live.insert(value["instance_id"].as_u64().context("instance_id")?, live_in("dynamo", start..start + size));
        }
    }
    Ok((publishers, live))
}

/// The kv-events messages of one capture, in the order received: (publisher, frames).
fn kv_messages(file: &str) -> anyhow::Result<Vec<(u64, Vec<Vec<u8>>)>> {
    fixtures::captured(file)?
        .iter()
        .filter(|m| m["topic"] == "kv-events")
        .map(|m| Ok((m["decoded"]["publisher_id_frame_u64be"].as_u64().context("publisher")?, frames(m))))
        .collect()
}

fn decoded(frames: &[Vec<u8>], publisher: u64) -> KvEventBatch {
    crate::kv::decode::decode_kv_events(frames.iter().map(Vec::as_slice), publisher).unwrap()
}

/// What each rank holds by the plainest reading of the events: engine hash → tokens path.
#[derive(Default)]
struct Model {
    ranks: HashMap<RankKey, HashMap<u64, Vec<u64>>>,
}

impl Model {
    fn apply(&mut self, event: &KvEvent) {
        let rank = RankKey { worker_id: event.worker_id, dp_rank: event.dp_rank };
        let held = self.ranks.entry(rank).or_default();
        match &event.data {
            KvEventData::Stored(stored) => {
                let mut path = match stored.parent_hash {
                    None => Vec::new(),
                    Some(parent) => match held.get(&parent) {
                        Some(path) => path.clone(),
                        None => return,
                    },
                };
                for block in &stored.blocks {
                    path.push(block.tokens_hash);
                    held.insert(block.block_hash, path.clone());
                }
            }
            KvEventData::Removed(hashes) => hashes.iter().for_each(|h| drop(held.remove(h))),
            KvEventData::Cleared => held.clear(),
        }
    }

    /// The rank's longest prefix of `path` it holds node by node.
    fn score(&self, rank: RankKey, path: &[u64]) -> u32 {
        let paths: HashSet<&[u64]> =
            self.ranks.get(&rank).map(|h| h.values().map(Vec::as_slice).collect()).unwrap_or_default();
        let held = (1..=path.len()).take_while(|n| paths.contains(&path[..*n])).count();
        u32::try_from(held).unwrap()
    }

    /// Asserts the indexer's contents equal the model's: blocks per rank, and every rank's score
    /// for every path any rank holds.
    fn assert_matches(&self, indexer: &KvIndexer) {
        let index_ranks: HashSet<RankKey> = indexer.index().ranks().collect();
        let model_ranks: HashSet<RankKey> = self.ranks.iter().filter(|(_, h)| !h.is_empty()).map(|(r, _)| *r).collect();
        assert_eq!(index_ranks, model_ranks);
        let mut checked = 0;
        for (rank, held) in &self.ranks {
            assert_eq!(indexer.index().rank_blocks(*rank), held.len(), "{rank:?}");
            for path in held.values() {
                let matches = indexer.find_matches(path);
                for other in self.ranks.keys() {
                    assert_eq!(matches.score(*other), self.score(*other, path), "{other:?} on {path:?}");
                    checked += 1;
                }
            }
        }
        assert!(checked > 0 || self.ranks.values().all(HashMap::is_empty));
    }
}

/// Replays `messages` into a fresh indexer live per the agg dump; returns it, the counts, and
/// the model fed every event the indexer was expected to apply.
fn replay(messages: &[(u64, Vec<Vec<u8>>)]) -> anyhow::Result<(KvIndexer, KvCounts, Model)> {
    let (publishers, live) = agg_discovery()?;
    let mut indexer = KvIndexer::default();
    indexer.set_live(live);
    let (mut counts, mut model) = (KvCounts::default(), Model::default());
    for (publisher, frames) in messages {
        let mapping = publishers.get(publisher).context("every captured publisher has an event source")?;
        counts.merge(&indexer.apply_message(mapping, frames.iter().map(Vec::as_slice)));
        decoded(frames, *publisher).events.iter().for_each(|e| model.apply(e));
    }
    Ok((indexer, counts, model))
}

#[test]
fn the_dp2_runs_replayed_in_order_index_what_a_plain_replay_holds() -> anyhow::Result<()> {
    let short = kv_messages("agg/zmq-messages.jsonl")?;
    let (indexer, counts, model) = replay(&short)?;
    model.assert_matches(&indexer);
    assert_eq!(counts.iter().collect::<Vec<_>>(), [(KvEventResult::Applied, 6)]);
    assert_eq!(indexer.index().stats().ranks, 2, "both dp ranks of the one worker");

    let evictions = kv_messages("agg/zmq-messages-under-load-evictions.jsonl")?;
    let (indexer, counts, model) = replay(&evictions)?;
    model.assert_matches(&indexer);
    for refused in
        [KvEventResult::Replay, KvEventResult::Gap, KvEventResult::IdentityMismatch, KvEventResult::OtherTier]
    {
        assert_eq!(counts.get(refused), 0, "{refused:?}");
    }
    assert!(counts.get(KvEventResult::Applied) > 20, "{counts:?}");
    assert!(counts.get(KvEventResult::UnknownBlock) > 0, "the capture starts mid-stream: {counts:?}");
    assert!(counts.blocks.get(continuum_kv_index::KvResult::Applied) > 300, "{counts:?}");
    Ok(())
}

#[test]
fn a_replayed_stream_is_skipped_and_changes_nothing() -> anyhow::Result<()> {
    let evictions = kv_messages("agg/zmq-messages-under-load-evictions.jsonl")?;
    let (publishers, _) = agg_discovery()?;
    let (mut indexer, _, model) = replay(&evictions)?;
    let events: usize = evictions.iter().map(|(p, f)| decoded(f, *p).events.len()).sum();
    let mut again = KvCounts::default();
    for (publisher, frames) in &evictions {
        again.merge(&indexer.apply_message(&publishers[publisher], frames.iter().map(Vec::as_slice)));
    }
    // Each rank's last event carries the id its cursor holds: the same engine step, applied
    // again (its removal finds the blocks gone), changing nothing.
    let again: Vec<_> = again.iter().collect();
    assert_eq!(again, [(KvEventResult::UnknownBlock, 2), (KvEventResult::Replay, u32::try_from(events)? - 2)]);
    model.assert_matches(&indexer);
    Ok(())
}

#[test]
fn a_missed_message_clears_the_rank_and_it_rebuilds_from_what_follows() -> anyhow::Result<()> {
    let mut evictions = kv_messages("agg/zmq-messages-under-load-evictions.jsonl")?;
    let (lost_publisher, lost_frames) = evictions.remove(10);
    let lost_rank = decoded(&lost_frames, lost_publisher).events[0].dp_rank;
    let resumes = 10 + evictions[10..].iter().position(|(p, _)| *p == lost_publisher).context("later")?;
    // The model of the gap: the rank starts over at its publisher's next message. Checked right
    // after it (later evictions would hide stale blocks) and at the end.
    for end in [resumes + 1, evictions.len()] {
        let (indexer, counts, _) = replay(&evictions[..end])?;
        assert_eq!(counts.get(KvEventResult::Gap), 1, "{counts:?}");
        let mut model = Model::default();
        for (i, (publisher, frames)) in evictions[..end].iter().enumerate() {
            if i == resumes {
                model.ranks.retain(|rank, _| rank.dp_rank != lost_rank);
            }
            decoded(frames, *publisher).events.iter().for_each(|e| model.apply(e));
        }
        model.assert_matches(&indexer);
    }
    Ok(())
}

#[test]
fn a_refused_message_clears_its_publishers_ranks_at_once() -> anyhow::Result<()> {
    let short = kv_messages("agg/zmq-messages.jsonl")?;
    let (mut indexer, _, model) = replay(&short)?;
    let (publishers, _) = agg_discovery()?;
    let (publisher, frames) = short.last().context("a message")?;
    let mapping = publishers.get(publisher).context("its event source")?;
    let lost_rank = decoded(frames, *publisher).events[0].dp_rank;
    let rank = |dp_rank| RankKey { worker_id: mapping.worker_id, dp_rank };
    let other = model.ranks.keys().find(|r| r.dp_rank != lost_rank).copied().context("the other rank")?;
    let held = indexer.index().rank_blocks(other);
    assert!(indexer.index().rank_blocks(rank(lost_rank)) > 0 && held > 0);

    // The envelope cut short: not decodable, so whatever it said is lost.
    let mut cut = frames.clone();
    let last = cut.last_mut().context("frames")?;
    last.truncate(last.len() / 2);
    let counts = indexer.apply_message(mapping, cut.iter().map(Vec::as_slice));
    assert_eq!(counts.get(KvEventResult::Malformed), 1, "{counts:?}");
    assert_eq!(counts.get(KvEventResult::Gap), 1, "the publisher's one rank, cleared: {counts:?}");
    assert_eq!(indexer.index().rank_blocks(rank(lost_rank)), 0);
    assert_eq!(indexer.index().rank_blocks(other), held, "another publisher's rank is not its to lose");

    // A message naming another publisher was never this stream's: nothing is cleared for it.
    let (mut indexer, _, _) = replay(&short)?;
    let (_, foreign) = short.iter().find(|(p, _)| p != publisher).context("the other publisher's message")?;
    let counts = indexer.apply_message(mapping, foreign.iter().map(Vec::as_slice));
    assert_eq!(counts.get(KvEventResult::IdentityMismatch), 1, "{counts:?}");
    assert_eq!(counts.get(KvEventResult::Gap), 0, "{counts:?}");
    assert!(indexer.index().rank_blocks(rank(lost_rank)) > 0);
    Ok(())
}

const WORKER: u64 = 7_668_682_560_356_784_048;

/// Publisher `id` of the fixtures' namespace.
fn live_in(namespace: &str, ranks: std::ops::Range<u32>) -> LiveWorker {
    LiveWorker { namespace: namespace.into(), publishing: ranks.len(), ranks }
}

fn key(id: u64) -> PublisherKey {
    PublisherKey { namespace: "dynamo".into(), publisher_id: id }
}

fn publisher() -> PublisherMapping {
    PublisherMapping { publisher: key(9), worker_id: WORKER, dp_rank: None }
}

fn event(dp_rank: u32, event_id: u64, data: KvEventData) -> KvEvent {
    KvEvent {
        worker_id: WORKER,
        dp_rank,
        event_id,
        storage_tier: StorageTier::Device,
        residency_domain: ResidencyDomain::Worker,
        data,
    }
}

fn stored(dp_rank: u32, event_id: u64, parent: Option<u64>, hashes: &[u64]) -> KvEvent {
    let blocks = hashes.iter().map(|h| StoredBlock { block_hash: *h, tokens_hash: h + 1000 }).collect();
    event(dp_rank, event_id, KvEventData::Stored(Stored { parent_hash: parent, start_position: None, blocks }))
}

fn live_indexer(ranks: Range<u32>) -> KvIndexer {
    let mut indexer = KvIndexer::default();
    indexer.set_live(LiveRanks::from([(WORKER, live_in("dynamo", ranks))]));
    indexer
}

fn results(counts: &KvCounts) -> Vec<(&'static str, u32)> {
    counts.iter().map(|(r, n)| (r.as_str(), n)).collect()
}

fn rank(dp_rank: u32) -> RankKey {
    RankKey { worker_id: WORKER, dp_rank }
}

/// Dynamo's vLLM publisher gives every event of one engine step the step's sequence as its id
/// (and may send them in more than one message): each applies, and the next step is no gap.
#[test]
fn events_of_one_engine_step_share_an_id_and_all_apply() {
    let mut indexer = live_indexer(0..1);
    let step = [stored(0, 5, None, &[1]), stored(0, 5, Some(1), &[2])];
    assert_eq!(results(&indexer.apply_events(&publisher(), &step)), [("applied", 2)]);
    let rest = [stored(0, 5, Some(2), &[3]), stored(0, 6, Some(3), &[4])];
    assert_eq!(
        results(&indexer.apply_events(&publisher(), &rest)),
        [("applied", 2)],
        "the step went on; then the next"
    );
    assert_eq!(indexer.find_matches(&[1001, 1002, 1003, 1004]).score(rank(0)), 4);
    let earlier = [stored(0, 5, Some(4), &[5])];
    assert_eq!(results(&indexer.apply_events(&publisher(), &earlier)), [("replay", 1)], "a step already passed");
}

#[test]
fn a_lost_message_is_one_gap_however_its_rank_hears_of_it() {
    let mut indexer = live_indexer(0..1);
    indexer.apply_events(&publisher(), &[stored(0, 1, None, &[1, 2])]);
    let mut counts = KvCounts::default();
    indexer.message_lost(&key(9), &mut counts);
    indexer.message_lost(&key(9), &mut counts);
    assert_eq!(results(&counts), [("gap", 1)], "cleared once");
    assert_eq!(indexer.index().rank_blocks(rank(0)), 0);

    // The lost message held event 2: event 3's jump is the gap already counted.
    let counts = indexer.apply_events(&publisher(), &[stored(0, 3, None, &[5])]);
    assert_eq!(results(&counts), [("applied", 1)]);
    assert_eq!(indexer.index().rank_blocks(rank(0)), 1, "applied on the cleared rank, not cleared again");
    // Past that, a jump is a gap of its own.
    let counts = indexer.apply_events(&publisher(), &[stored(0, 5, None, &[6])]);
    assert_eq!(results(&counts), [("applied", 1), ("gap", 1)]);
    assert_eq!(indexer.index().rank_blocks(rank(0)), 1);
}

/// A loss, the same step going on, then another loss: the second clears what the step
/// stored since the first, since it may have held its removals.
#[test]
fn a_second_loss_after_the_step_went_on_clears_again() {
    let mut indexer = live_indexer(0..1);
    indexer.apply_events(&publisher(), &[stored(0, 5, None, &[1])]);
    let mut counts = KvCounts::default();
    indexer.message_lost(&key(9), &mut counts);
    indexer.apply_events(&publisher(), &[stored(0, 5, None, &[2])]);
    assert_eq!(indexer.index().rank_blocks(rank(0)), 1, "the step went on after the first loss");
    let mut counts = KvCounts::default();
    indexer.message_lost(&key(9), &mut counts);
    assert_eq!(results(&counts), [("gap", 1)]);
    assert_eq!(indexer.index().rank_blocks(rank(0)), 0);
}

#[test]
fn a_message_number_past_the_next_says_messages_were_lost() {
    let mut last = None;
    let lost: Vec<bool> = [4, 5, 7, 8, 8, 6, 9, 12].into_iter().map(|n| lost_before(&mut last, n, false)).collect();
    // The first sets the count; 7 skips 6; a repeat or an older one loses nothing; 12 skips two.
    assert_eq!(lost, [false, false, true, false, false, false, false, true]);
    assert_eq!(last, Some(12));
    assert!(!lost_before(&mut Some(u64::MAX), u64::MAX, false), "no overflow at the end of the count");
    // One numbered far ahead does not turn the count off: the next, far behind it, is
    // where it stands, and a skip after that is seen.
    let mut last = Some(12);
    let lost: Vec<bool> = [u64::MAX, 13, 14, 16].into_iter().map(|n| lost_before(&mut last, n, false)).collect();
    assert_eq!(lost, [true, false, false, true]);
    // A session's first message: only the next number lost nothing; one at or below the last
    // says the count started over, and is where it stands.
    for (first, lost, now) in [(17, false, 17), (18, true, 18), (16, true, 16), (3, true, 3)] {
        let mut last = Some(16);
        assert_eq!((lost_before(&mut last, first, true), last), (lost, Some(now)), "first {first}");
    }
    assert!(!lost_before(&mut None, 40, true), "the first ever: nothing known lost");
}

/// What a publisher sent while no session listened is lost, and its next message's number
/// says so even where the event ids cannot (the lost message was the end of the step the last
/// heard message began): its ranks are cleared as on a gap.
#[test]
fn messages_published_while_no_session_listened_are_a_gap() {
    let mut indexer = live_indexer(0..2);
    let (mut counts, t0) = (KvCounts::default(), Instant::now());
    indexer.publisher_up(&key(9));
    assert!(indexer.numbered(&key(9), 10, &mut counts).is_empty());
    indexer.apply_events(&publisher(), &[stored(0, 100, None, &[1]), stored(1, 100, None, &[1])]);
    // A reconnect that missed nothing: the next number.
    indexer.publisher_down(&key(9), t0);
    indexer.publisher_up(&key(9));
    assert!(indexer.numbered(&key(9), 11, &mut counts).is_empty());
    assert_eq!(results(&counts), [], "nothing lost");
    // Message 12 (step 100's removal of block 1) went out while the session was down.
    indexer.publisher_down(&key(9), t0);
    indexer.publisher_up(&key(9));
    let mut lost = indexer.numbered(&key(9), 13, &mut counts);
    lost.sort_unstable();
    assert_eq!(lost, [rank(0), rank(1)]);
    assert_eq!(results(&counts), [("gap", 2)]);
    lost.into_iter().for_each(|rank| _ = indexer.clear_rank(rank));
    let counts = indexer.apply_events(&publisher(), &[stored(0, 101, None, &[2])]);
    assert_eq!(results(&counts), [("applied", 1)], "the next step's id is no second gap");
    assert!(indexer.find_matches(&[1001]).is_empty(), "block 1, removed unheard, is gone");
}

/// One event numbered far ahead of its order (or a counter that started over) leaves every
/// later event far behind: after a few in a row the rank starts over from them, cleared, rather
/// than refusing its events (removals included) until the publisher leaves. A replay near the
/// cursor stays a replay.
#[test]
fn events_far_behind_the_cursor_start_the_rank_over() {
    let mut indexer = live_indexer(0..1);
    indexer.apply_events(&publisher(), &[stored(0, 1, None, &[1])]);
    assert_eq!(
        results(&indexer.apply_events(&publisher(), &[stored(0, u64::MAX, None, &[2])])),
        [("applied", 1), ("gap", 1)]
    );
    let behind: Vec<_> =
        (2..2 + u64::from(FAR_BEHIND_BEFORE_RESTART) - 1).map(|id| stored(0, id, None, &[id + 100])).collect();
    assert_eq!(results(&indexer.apply_events(&publisher(), &behind)), [("replay", FAR_BEHIND_BEFORE_RESTART - 1)]);
    let next = 2 + u64::from(FAR_BEHIND_BEFORE_RESTART);
    let counts = indexer.apply_events(&publisher(), &[stored(0, next, None, &[7]), stored(0, next + 1, Some(7), &[8])]);
    assert_eq!(results(&counts), [("applied", 2), ("gap", 1)], "started over at {next}");
    assert_eq!(indexer.index().rank_blocks(rank(0)), 2, "cleared, then what followed");

    // Near the cursor, however many: replays.
    let near: Vec<_> = (0..20).map(|_| stored(0, next, None, &[9])).collect();
    let counts = indexer.apply_events(&publisher(), &[stored(0, next + 5, None, &[10])]);
    assert_eq!(results(&counts), [("applied", 1), ("gap", 1)]);
    assert_eq!(results(&indexer.apply_events(&publisher(), &near)), [("replay", 20)]);
}

#[test]
fn the_first_event_sets_the_cursor_and_a_jump_clears_before_applying() {
    let mut indexer = live_indexer(0..1);
    let counts = indexer.apply_events(&publisher(), &[stored(0, 378, None, &[1, 2]), stored(0, 379, Some(2), &[3])]);
    assert_eq!(results(&counts), [("applied", 2)], "mid-stream start is not a gap");
    assert_eq!(indexer.find_matches(&[1001, 1002, 1003]).score(rank(0)), 3);

    let counts = indexer.apply_events(&publisher(), &[stored(0, 385, None, &[5])]);
    assert_eq!(results(&counts), [("applied", 1), ("gap", 1)]);
    assert_eq!(indexer.index().rank_blocks(rank(0)), 1, "the earlier chain was cleared");
    assert_eq!(indexer.cursor(&key(9), rank(0)), Some(385));
    let counts = indexer.apply_events(&publisher(), &[stored(0, 380, Some(2), &[4]), stored(0, 384, None, &[6])]);
    assert_eq!(results(&counts), [("replay", 2)]);
}

#[test]
fn events_outside_the_publishers_live_identity_are_refused_and_move_no_cursor() {
    let mut indexer = live_indexer(0..2);
    let other_worker = KvEvent { worker_id: WORKER + 1, ..stored(0, 1, None, &[1]) };
    let pinned = PublisherMapping { dp_rank: Some(1), ..publisher() };
    let cases = [
        ("another worker's event", publisher(), other_worker),
        ("a rank past the declared range", publisher(), stored(2, 1, None, &[1])),
        ("a rank the event source does not name", pinned.clone(), stored(0, 1, None, &[1])),
        (
            "a publisher mapped to another worker",
            PublisherMapping { worker_id: 5, ..publisher() },
            stored(0, 1, None, &[1]),
        ),
    ];
    for (what, publisher, event) in cases {
        let counts = indexer.apply_events(&publisher, &[event]);
        assert_eq!(results(&counts), [("identity_mismatch", 1)], "{what}");
    }
    assert_eq!(indexer.index().stats().ranks, 0);
    assert_eq!(indexer.cursor(&key(9), rank(0)), None);
    assert_eq!(results(&indexer.apply_events(&pinned, &[stored(1, 1, None, &[1])])), [("applied", 1)]);

    let mut nothing_live = KvIndexer::default();
    assert_eq!(
        results(&nothing_live.apply_events(&publisher(), &[stored(0, 1, None, &[1])])),
        [("identity_mismatch", 1)]
    );
}

#[test]
fn set_live_clears_departed_ranks_and_their_cursors() {
    let mut indexer = live_indexer(0..2);
    indexer.apply_events(&publisher(), &[stored(0, 1, None, &[1]), stored(1, 1, None, &[1])]);
    assert_eq!(
        indexer.set_live(LiveRanks::from([(WORKER, live_in("dynamo", 1..2))])),
        1,
        "rank 0 is no longer declared"
    );
    assert_eq!(indexer.find_matches(&[1001]).as_slice(), [(rank(1), 1)]);
    assert_eq!((indexer.cursor(&key(9), rank(0)), indexer.cursor(&key(9), rank(1))), (None, Some(1)));
    assert_eq!(results(&indexer.apply_events(&publisher(), &[stored(0, 50, None, &[1])])), [("identity_mismatch", 1)]);

    indexer.set_live(LiveRanks::from([(WORKER, live_in("dynamo", 0..2))]));
    assert_eq!(
        results(&indexer.apply_events(&publisher(), &[stored(0, 50, None, &[1])])),
        [("applied", 1)],
        "a rank that comes back starts a fresh cursor: no gap"
    );
    assert_eq!(indexer.set_live(LiveRanks::new()), 2);
    assert_eq!(indexer.index().stats().nodes, 0);
}

/// The feed clears departed ranks one at a time before `set_live` (each to a hold of the
/// lock): the same index as `set_live` alone leaves.
#[test]
fn departed_ranks_cleared_one_at_a_time_leave_what_set_live_would() {
    let mut indexer = live_indexer(0..3);
    let events = [stored(0, 1, None, &[1]), stored(1, 1, None, &[1, 2]), stored(2, 1, None, &[1])];
    indexer.apply_events(&publisher(), &events);
    let live = LiveRanks::from([(WORKER, live_in("dynamo", 1..2))]);
    let mut departed = indexer.departed(&live);
    departed.sort_by_key(|rank| rank.dp_rank);
    assert_eq!(departed, [rank(0), rank(2)]);
    for rank in departed {
        assert!(indexer.clear_departed(rank));
    }
    assert_eq!(indexer.set_live(live), 0, "nothing left for it to clear");
    assert_eq!(indexer.find_matches(&[1001, 1002]).as_slice(), [(rank(1), 2)]);
    assert_eq!(indexer.cursor(&key(9), rank(0)), None, "its cursors went with set_live");
}

/// The index is shared among every rank the live workers publish kv-events for (here, all).
#[test]
fn the_index_is_shared_among_the_live_ranks() {
    use continuum_kv_index::{MAX_BLOCKS_PER_RANK, MAX_INDEX_BLOCKS};
    let mut indexer = KvIndexer::default();
    assert_eq!(indexer.index().rank_share(), MAX_BLOCKS_PER_RANK, "nothing to share among");
    let workers = (1..=8u64).map(|id| (id, live_in("dynamo", 0..2)));
    indexer.set_live(workers.collect());
    assert_eq!(indexer.index().rank_share(), MAX_INDEX_BLOCKS / 16, "8 workers of 2 ranks each");
}

#[test]
fn other_tiers_and_domains_are_not_indexed_but_move_the_cursor() {
    let mut indexer = live_indexer(0..1);
    let disk = KvEvent { storage_tier: StorageTier::Disk, ..stored(0, 1, None, &[1]) };
    let owner = KvEvent { residency_domain: ResidencyDomain::CacheOwner, ..stored(0, 2, None, &[2]) };
    let counts = indexer.apply_events(&publisher(), &[disk, owner, stored(0, 3, None, &[3])]);
    assert_eq!(results(&counts), [("applied", 1), ("other_tier", 2)], "event 3 follows 2: no gap");
    assert!(indexer.find_matches(&[1001]).is_empty());
    assert_eq!(indexer.find_matches(&[1003]).score(rank(0)), 1);
}

#[test]
fn cleared_removed_and_unknown_parent_reach_the_index() {
    let mut indexer = live_indexer(0..1);
    let counts = indexer.apply_events(
        &publisher(),
        &[
            stored(0, 1, None, &[1, 2]),
            stored(0, 2, Some(99), &[3]),
            event(0, 3, KvEventData::Removed(vec![2, 42])),
            stored(0, 4, None, &[1]),
        ],
    );
    assert_eq!(results(&counts), [("applied", 1), ("duplicate", 1), ("unknown_block", 1), ("unknown_parent", 1)]);
    assert_eq!(counts.blocks.blocks(), 2 + 1 + 2 + 1);
    assert_eq!(indexer.find_matches(&[1001, 1002]).score(rank(0)), 1);
    let counts = indexer.apply_events(&publisher(), &[event(0, 5, KvEventData::Cleared)]);
    assert_eq!(results(&counts), [("applied", 1)]);
    assert_eq!(indexer.index().stats().ranks, 0);
}

#[test]
fn a_publisher_holds_at_most_4096_rank_cursors() {
    let ranks = u32::try_from(MAX_CURSORS_PER_PUBLISHER).unwrap();
    let mut indexer = live_indexer(0..ranks + 1);
    let events: Vec<KvEvent> = (0..=ranks).map(|r| event(r, 1, KvEventData::Cleared)).collect();
    let counts = indexer.apply_events(&publisher(), &events);
    assert_eq!(results(&counts), [("applied", ranks), ("over_capacity", 1)]);
    assert_eq!(indexer.cursor(&key(9), rank(ranks)), None);
    let another = PublisherMapping { publisher: key(10), ..publisher() };
    assert_eq!(results(&indexer.apply_events(&another, &[event(ranks, 1, KvEventData::Cleared)])), [("applied", 1)]);
}

/// One hold of the lock applies events until they touched a hold's blocks, counting what a
/// gap or a clear dropped: a message of one-block events, each a gap on another full rank, is
/// the ranks' size in work, and takes a hold a rank. The rest applies in the holds after.
#[test]
fn a_hold_ends_after_the_blocks_a_gap_or_a_clear_dropped() {
    let mut indexer = live_indexer(0..4);
    let chain: Vec<u64> = (1..=50).collect();
    let filled: Vec<KvEvent> = (0..4).map(|r| stored(r, 1, None, &chain)).collect();
    indexer.apply_events(&publisher(), &filled);
    // Event 3 after 1: each one a gap, clearing its rank's 50 blocks.
    let gaps: Vec<KvEvent> = (0..4).map(|r| stored(r, 3, None, &[100])).collect();
    let mut counts = KvCounts::default();
    assert_eq!(indexer.apply_events_within(&publisher(), &gaps, 40, &mut counts), 1, "one rank's clear fills a hold");
    assert_eq!((0..4).map(|r| indexer.index().rank_blocks(rank(r))).collect::<Vec<_>>(), [1, 50, 50, 50]);
    assert_eq!(indexer.apply_events_within(&publisher(), &gaps[1..], 200, &mut counts), 3, "room for all three");
    assert_eq!(results(&counts), [("applied", 4), ("gap", 4)]);
    let cleared = [event(0, 4, KvEventData::Cleared), event(1, 4, KvEventData::Cleared)];
    assert_eq!(indexer.apply_events_within(&publisher(), &cleared, 1, &mut counts), 1, "a clear ends the hold too");
    // Events that drop nothing are weighed by the blocks they name.
    let small: Vec<KvEvent> = (0..4).map(|r| stored(r, 5, Some(100), &[101, 102])).collect();
    assert_eq!(indexer.apply_events_within(&publisher(), &small, 4, &mut counts), 2);
}

/// A lost message's ranks, and a departed publisher's, are handed out to clear one at a time;
/// counted (as gaps) and forgotten at once, as [`KvIndexer::message_lost`] and
/// [`KvIndexer::drop_publisher`] do them whole.
#[test]
fn a_publishers_ranks_are_handed_out_to_clear_one_to_a_hold() {
    let mut indexer = live_indexer(0..3);
    let filled: Vec<KvEvent> = (0..3).map(|r| stored(r, 1, None, &[1, 2])).collect();
    indexer.apply_events(&publisher(), &filled);
    let mut counts = KvCounts::default();
    let mut lost = indexer.lose_message(&key(9), &mut counts);
    lost.sort_unstable();
    assert_eq!(lost, [rank(0), rank(1), rank(2)]);
    assert_eq!(results(&counts), [("gap", 3)]);
    assert!(indexer.lose_message(&key(9), &mut counts).is_empty(), "one loss, handed out once");
    assert_eq!(indexer.index().rank_blocks(rank(1)), 2, "nothing cleared until the caller does");
    assert_eq!(indexer.clear_rank(rank(1)), 2);
    assert_eq!(indexer.index().rank_blocks(rank(1)), 0);

    let mut gone = indexer.take_publisher(&key(9));
    gone.sort_unstable();
    assert_eq!(gone, [rank(0), rank(1), rank(2)]);
    assert_eq!(indexer.cursor(&key(9), rank(0)), None, "its cursors go at once");
    assert!(indexer.take_publisher(&key(9)).is_empty());
}

#[test]
fn a_publisher_stopped_for_good_loses_its_ranks_at_once() {
    let mut indexer = live_indexer(0..2);
    indexer.apply_events(&publisher(), &[stored(0, 1, None, &[1]), stored(1, 1, None, &[1])]);
    let other = PublisherMapping { publisher: key(10), dp_rank: Some(1), ..publisher() };
    indexer.apply_events(&other, &[stored(1, 7, None, &[2])]);
    assert_eq!(indexer.drop_publisher(&key(9)), 2);
    assert_eq!(indexer.cursor(&key(9), rank(0)), None);
    assert!(indexer.find_matches(&[1001]).is_empty());
    assert_eq!(indexer.cursor(&key(10), rank(1)), Some(7), "the other publisher keeps its cursor");
    assert_eq!(indexer.drop_publisher(&key(9)), 0);
}

#[test]
fn a_channel_with_the_same_id_in_another_namespace_touches_nothing_of_this_ones() {
    let t0 = Instant::now();
    let mut indexer = live_indexer(0..2);
    indexer.apply_events(&publisher(), &[stored(0, 1, None, &[1])]);
    let elsewhere = PublisherKey { namespace: "other".into(), publisher_id: 9 };
    let mut counts = KvCounts::default();
    indexer.message_lost(&elsewhere, &mut counts);
    indexer.publisher_down(&elsewhere, t0);
    assert!(clear_stale(&mut indexer, t0 + KV_EVENTS_STALE_AFTER, KV_EVENTS_STALE_AFTER).is_empty());
    assert_eq!(indexer.drop_publisher(&elsewhere), 0);
    assert_eq!(indexer.find_matches(&[1001]).as_slice(), [(rank(0), 1)], "this namespace's blocks stand");
    assert_eq!(indexer.cursor(&key(9), rank(0)), Some(1));
}

#[test]
fn a_subscription_down_for_the_stale_limit_loses_its_ranks_and_a_quiet_one_does_not() {
    let t0 = Instant::now();
    let mut indexer = live_indexer(0..2);
    let other = PublisherMapping { publisher: key(10), dp_rank: Some(1), ..publisher() };
    indexer.apply_events(&publisher(), &[stored(0, 1, None, &[1])]);
    indexer.apply_events(&other, &[stored(1, 1, None, &[1])]);

    indexer.publisher_down(&key(9), t0);
    indexer.publisher_down(&key(9), t0 + Duration::from_secs(30));
    let just_before = t0 + KV_EVENTS_STALE_AFTER - Duration::from_millis(1);
    assert!(clear_stale(&mut indexer, just_before, KV_EVENTS_STALE_AFTER).is_empty());
    assert_eq!(clear_stale(&mut indexer, t0 + KV_EVENTS_STALE_AFTER, KV_EVENTS_STALE_AFTER), [key(9)]);
    assert_eq!(indexer.find_matches(&[1001]).as_slice(), [(rank(1), 1)], "publisher 10 was quiet, not down");
    assert_eq!(indexer.cursor(&key(9), rank(0)), None);

    // Down, then up again within the limit: cursors carry over and missed events show as a gap.
    indexer.publisher_down(&key(10), t0);
    indexer.publisher_up(&key(10));
    assert!(clear_stale(&mut indexer, t0 + Duration::from_secs(3600), KV_EVENTS_STALE_AFTER).is_empty());
    let counts = indexer.apply_events(&other, &[stored(1, 5, None, &[3])]);
    assert_eq!(results(&counts), [("applied", 1), ("gap", 1)]);
}

#[test]
fn refused_messages_count_once_under_their_label() {
    let (publishers, live) = agg_discovery().unwrap();
    let mut indexer = KvIndexer::default();
    indexer.set_live(live);
    let (publisher, mut frames) = kv_messages("agg/zmq-messages.jsonl").unwrap().remove(0);
    frames[3].truncate(20);
    let counts = indexer.apply_message(&publishers[&publisher], frames.iter().map(Vec::as_slice));
    assert_eq!(results(&counts), [("malformed", 1)]);
    let wrong = PublisherMapping { publisher: key(publisher + 1), ..publishers[&publisher].clone() };
    let (_, frames) = kv_messages("agg/zmq-messages.jsonl").unwrap().remove(0);
    assert_eq!(results(&indexer.apply_message(&wrong, frames.iter().map(Vec::as_slice))), [("identity_mismatch", 1)]);
    assert_eq!(indexer.index().stats().ranks, 0);
}

/// Instance ids are unique per namespace only: a kv-events channel registered in another
/// namespace, whose event source names a live worker of this one, neither stores nor clears
/// that worker's blocks.
#[test]
fn a_publisher_of_another_namespace_does_not_speak_for_a_worker_of_this_one() {
    let mut indexer = live_indexer(0..1);
    let stranger =
        PublisherMapping { publisher: PublisherKey { namespace: "other".into(), publisher_id: 9 }, ..publisher() };
    assert_eq!(results(&indexer.apply_events(&stranger, &[stored(0, 1, None, &[1])])), [("identity_mismatch", 1)]);
    assert_eq!(indexer.index().stats().ranks, 0);
    assert_eq!(results(&indexer.apply_events(&publisher(), &[stored(0, 1, None, &[1])])), [("applied", 1)]);
    let cleared = event(0, 1, KvEventData::Cleared);
    assert_eq!(results(&indexer.apply_events(&stranger, &[cleared])), [("identity_mismatch", 1)]);
    assert_eq!(indexer.index().stats().ranks, 1, "the worker's blocks stay");
}

/// What the sweep does: drops each publisher down for `stale_after`; returns them.
fn clear_stale(indexer: &mut KvIndexer, now: Instant, stale_after: Duration) -> Vec<PublisherKey> {
    let stale = indexer.stale(now, stale_after);
    stale.into_iter().filter(|key| indexer.drop_if_stale(key, now, stale_after)).collect()
}

/// The sweep lists stale publishers under one hold of the lock and drops each under another:
/// one that came back in between, and published, keeps what it published.
#[test]
fn a_publisher_back_before_the_sweep_drops_it_keeps_its_blocks() {
    let t0 = Instant::now();
    let mut indexer = live_indexer(0..1);
    indexer.apply_events(&publisher(), &[stored(0, 1, None, &[1])]);
    indexer.publisher_down(&key(9), t0);
    let later = t0 + KV_EVENTS_STALE_AFTER;
    assert_eq!(indexer.stale(later, KV_EVENTS_STALE_AFTER), [key(9)]);
    indexer.publisher_up(&key(9));
    indexer.apply_events(&publisher(), &[stored(0, 2, Some(1), &[2])]);
    assert!(!indexer.drop_if_stale(&key(9), later, KV_EVENTS_STALE_AFTER), "back, so not stale");
    assert_eq!(indexer.find_matches(&[1001, 1002]).as_slice(), [(rank(0), 2)]);
    assert_eq!(indexer.cursor(&key(9), rank(0)), Some(2));
    indexer.publisher_down(&key(9), later);
    assert!(indexer.drop_if_stale(&key(9), later + KV_EVENTS_STALE_AFTER, KV_EVENTS_STALE_AFTER));
    assert_eq!(indexer.cursor(&key(9), rank(0)), None);
}

/// What the feed and the sweep do a rank at a time, done at once, for the tests.
impl KvIndexer {
    fn drop_publisher(&mut self, publisher: &PublisherKey) -> usize {
        let mut cleared = 0;
        for rank in self.take_publisher(publisher) {
            cleared += usize::from(self.clear_rank(rank) > 0);
        }
        cleared
    }

    fn drop_if_stale(&mut self, publisher: &PublisherKey, now: Instant, stale_after: Duration) -> bool {
        let Some(ranks) = self.take_if_stale(publisher, now, stale_after) else { return false };
        for rank in ranks {
            self.clear_rank(rank);
        }
        true
    }
}
