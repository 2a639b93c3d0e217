//! Where a routing run's requests waited, from what the client saw of each: when it was sent,
//! its first token, its end and the workers that prefilled and decoded it (Dynamo's
//! `nvext.worker_id` echo).
//!
//! The 1.6.1 mocker prefills the requests that arrived during a step in the next one, so a
//! request sent while another on its prefilling worker still awaits its first token waits
//! behind that prefill. A router could have spared it only if another worker that prefills had
//! none awaiting. When every such worker has as many awaiting, the one whose newest awaiting
//! request was sent first should answer first: sending to another makes the request wait
//! behind a prefill that began later. And every prefill that begins on an aggregated worker
//! lengthens the decode steps of the requests already there, so the end-to-end tail is the
//! requests that decoded beside the most.

/// One answered request, as the client saw it (milliseconds from the run's start).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Served {
    pub start_ms: f64,
    pub ttft_ms: f64,
    pub e2e_ms: f64,
    /// The same worker on an aggregated fleet.
    pub prefill_worker: u64,
    pub decode_worker: u64,
}

impl Served {
    fn awaits_first_token(&self, at: f64) -> bool {
        self.start_ms <= at && at < self.start_ms + self.ttft_ms
    }

    fn end_ms(&self) -> f64 {
        self.start_ms + self.e2e_ms
    }
}

/// Requests sent within this long of a run's first are its opening burst: the clients start
/// together, on a cold fleet, before any worker has answered or any load has been reported.
pub const OPENING_MS: f64 = 20.0;

/// A run's opening burst: how it split across the workers that prefill, and how slow it was.
/// Its requests are a run's slowest first tokens on unique prompts, so they decide a pooled
/// TTFT p99.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Opening {
    pub requests: usize,
    /// A worker that prefills took more than its even share of the burst.
    pub uneven: bool,
    /// The burst's slowest first token.
    pub slowest_ttft_ms: f64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Placement {
    /// Requests sent while another request on their prefilling worker still awaited its first
    /// token…
    pub queued: usize,
    /// …of which another worker that prefills had none awaiting: a router could have spared
    /// them the wait.
    pub avoidable: usize,
    /// Queued requests sent while every worker that prefills had as many awaiting…
    pub level: usize,
    /// …of which their worker's newest awaiting request was sent after another such worker's
    /// newest: they queued behind the prefill that began later.
    pub behind_later: usize,
    /// The slowest 1% end to end: the other requests in flight on their decode worker, on
    /// average over their time…
    pub tail_beside: f64,
    /// …and the requests sent to that worker while they decoded (after their first token).
    pub tail_prefills: f64,
    /// The run's opening burst.
    pub opening: Opening,
}

fn in_opening(served: &[Served]) -> impl Fn(&Served) -> bool {
    let first = served.iter().map(|s| s.start_ms).fold(f64::INFINITY, f64::min);
    move |s| s.start_ms < first + OPENING_MS
}

/// The first tokens of `served` outside its opening burst, sorted.
pub fn ttft_after_opening(served: &[Served]) -> Vec<f64> {
    let in_burst = in_opening(served);
    let mut ttft: Vec<f64> = served.iter().filter(|s| !in_burst(s)).map(|s| s.ttft_ms).collect();
    ttft.sort_by(f64::total_cmp);
    ttft
}

fn opening(served: &[Served], prefilling: &[u64]) -> Opening {
    let in_burst = in_opening(served);
    let burst: Vec<&Served> = served.iter().filter(|s| in_burst(s)).collect();
    let even_share = burst.len().div_ceil(prefilling.len().max(1));
    let on = |worker: u64| burst.iter().filter(|s| s.prefill_worker == worker).count();
    Opening {
        requests: burst.len(),
        uneven: prefilling.iter().any(|w| on(*w) > even_share),
        slowest_ttft_ms: burst.iter().map(|s| s.ttft_ms).fold(0.0, f64::max),
    }
}

/// How `served` queued on its workers (every worker that prefilled one of them).
pub fn placement(served: &[Served]) -> Placement {
    let mut prefilling: Vec<u64> = served.iter().map(|s| s.prefill_worker).collect();
    prefilling.sort_unstable();
    prefilling.dedup();
    let mut placement = Placement { opening: opening(served, &prefilling), ..Placement::default() };
    for (i, request) in served.iter().enumerate() {
        // How many requests await their first token on `worker`, and when the newest was sent.
        let awaiting = |worker: u64| {
            let on_worker = served.iter().enumerate().filter(|(j, other)| {
                *j != i && other.prefill_worker == worker && other.awaits_first_token(request.start_ms)
            });
            on_worker.fold((0, f64::NEG_INFINITY), |(n, newest), (_, other)| (n + 1, other.start_ms.max(newest)))
        };
        let (mine, my_newest) = awaiting(request.prefill_worker);
        if mine == 0 {
            continue;
        }
        placement.queued += 1;
        let others: Vec<(usize, f64)> =
            prefilling.iter().filter(|w| **w != request.prefill_worker).map(|w| awaiting(*w)).collect();
        if others.iter().any(|(n, _)| *n == 0) {
            placement.avoidable += 1;
        }
        if others.iter().all(|(n, _)| *n == mine) {
            placement.level += 1;
            if others.iter().any(|(_, newest)| *newest < my_newest) {
                placement.behind_later += 1;
            }
        }
    }
    let mut by_e2e: Vec<usize> = (0..served.len()).collect();
    by_e2e.sort_by(|a, b| served[*b].e2e_ms.total_cmp(&served[*a].e2e_ms));
    let tail = &by_e2e[..served.len().div_ceil(100)];
    for &i in tail {
        let request = &served[i];
        let decoding = request.start_ms + request.ttft_ms..request.end_ms();
        let beside = served.iter().enumerate().filter(|(j, o)| *j != i && o.decode_worker == request.decode_worker);
        for (_, other) in beside {
            let overlap = request.end_ms().min(other.end_ms()) - request.start_ms.max(other.start_ms);
            placement.tail_beside += overlap.max(0.0) / request.e2e_ms.max(f64::EPSILON);
            if decoding.contains(&other.start_ms) {
                placement.tail_prefills += 1.0;
            }
        }
    }
    if !tail.is_empty() {
        placement.tail_beside /= tail.len() as f64;
        placement.tail_prefills /= tail.len() as f64;
    }
    placement
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On an aggregated worker, which prefills what it decodes.
    fn served(start_ms: f64, ttft_ms: f64, e2e_ms: f64, worker: u64) -> Served {
        Served { start_ms, ttft_ms, e2e_ms, prefill_worker: worker, decode_worker: worker }
    }

    fn paired(start_ms: f64, prefill_worker: u64, decode_worker: u64) -> Served {
        Served { start_ms, ttft_ms: 50.0, e2e_ms: 500.0, prefill_worker, decode_worker }
    }

    #[test]
    fn a_request_behind_a_prefill_queued_and_was_avoidable_only_if_another_worker_was_free() {
        // 2 is sent to worker 1 while 1 awaits its first token there; worker 2 is idle.
        let free_elsewhere = [served(0.0, 50.0, 500.0, 1), served(10.0, 80.0, 500.0, 1), served(600.0, 40.0, 400.0, 2)];
        assert_eq!(placement(&free_elsewhere).queued, 1);
        assert_eq!(placement(&free_elsewhere).avoidable, 1);
        // Worker 2 is prefilling too: no worker was free.
        let both_busy = [served(0.0, 50.0, 500.0, 1), served(10.0, 80.0, 500.0, 1), served(5.0, 40.0, 400.0, 2)];
        assert_eq!(placement(&both_busy).queued, 1);
        assert_eq!(placement(&both_busy).avoidable, 0);
        // Sent after the first token: decoding beside it is not queueing.
        let after_first_token = [served(0.0, 50.0, 500.0, 1), served(60.0, 40.0, 500.0, 1)];
        assert_eq!(placement(&after_first_token).queued, 0);
    }

    #[test]
    fn with_level_queues_a_request_sent_behind_the_prefill_that_began_later_is_counted() {
        // Both workers have one request awaiting its first token when 2 is sent at 20 ms:
        // worker 1's since 0 ms, worker 2's since 15 ms.
        let behind_later = [served(0.0, 50.0, 500.0, 1), served(15.0, 50.0, 500.0, 2), served(20.0, 80.0, 500.0, 2)];
        let counted = placement(&behind_later);
        assert_eq!((counted.queued, counted.level, counted.behind_later), (1, 1, 1));
        // Sent to worker 1, whose prefill began first.
        let behind_earlier = [served(0.0, 50.0, 500.0, 1), served(15.0, 50.0, 500.0, 2), served(20.0, 80.0, 500.0, 1)];
        let counted = placement(&behind_earlier);
        assert_eq!((counted.queued, counted.level, counted.behind_later), (1, 1, 0));
        // Worker 1 has two awaiting: the queues are not level, whatever the order.
        let uneven = [
            served(0.0, 50.0, 500.0, 1),
            served(1.0, 50.0, 500.0, 1),
            served(15.0, 50.0, 500.0, 2),
            served(20.0, 80.0, 500.0, 2),
        ];
        let counted = placement(&uneven);
        assert_eq!((counted.level, counted.behind_later), (0, 0));
    }

    #[test]
    fn the_tail_is_told_by_what_ran_beside_it_and_what_arrived_while_it_decoded() {
        // The slowest (0) has 1 beside it the whole time and 2 half the time; 2 arrived while
        // it decoded. Worker 2's request never ran beside it.
        let run = [
            served(0.0, 50.0, 1000.0, 1),
            served(0.0, 50.0, 1000.0, 1),
            served(500.0, 50.0, 500.0, 1),
            served(0.0, 50.0, 999.0, 2),
        ];
        let placement = placement(&run);
        assert_eq!(placement.tail_beside, 1.5, "one request is the slowest 1% of four");
        assert_eq!(placement.tail_prefills, 1.0, "the one sent at 500 ms, after the first token at 50 ms");
    }

    #[test]
    fn a_pair_queues_on_its_prefill_worker_and_decodes_beside_its_decode_workers_requests() {
        // Prefill workers 10 and 11, decode workers 20 and 21. 1 is sent while 0 awaits its first
        // token on prefill worker 10, with 11 free; they decode on different workers.
        let free_prefill_worker = [paired(0.0, 10, 20), paired(10.0, 10, 21), paired(600.0, 11, 20)];
        assert_eq!(placement(&free_prefill_worker).queued, 1);
        assert_eq!(placement(&free_prefill_worker).avoidable, 1);
        // Same decode worker, different prefill workers: no queueing, but decoding side by side.
        let side_by_side = [paired(0.0, 10, 20), paired(0.0, 11, 20)];
        assert_eq!(placement(&side_by_side).queued, 0);
        assert_eq!(placement(&side_by_side).tail_beside, 1.0);
    }

    #[test]
    fn an_opening_burst_is_uneven_when_a_worker_takes_more_than_its_share() {
        // Five requests within 20 ms of the first: three on worker 1, two on worker 2.
        let mut run = vec![
            served(100.0, 180.0, 500.0, 1),
            served(101.0, 230.0, 500.0, 1),
            served(105.0, 150.0, 500.0, 2),
            served(110.0, 90.0, 500.0, 2),
            served(119.0, 120.0, 500.0, 1),
            served(120.0, 400.0, 500.0, 2),
            served(300.0, 60.0, 500.0, 1),
        ];
        let burst = placement(&run).opening;
        assert_eq!(burst, Opening { requests: 5, uneven: false, slowest_ttft_ms: 230.0 }, "3 of 5 is the even share");
        assert_eq!(ttft_after_opening(&run), vec![60.0, 400.0], "sent 20 ms or more after the first");
        run[3].prefill_worker = 1;
        assert!(placement(&run).opening.uneven, "4 of 5 on one worker");
    }

    #[test]
    fn nothing_served_tells_nothing() {
        assert_eq!(placement(&[]), Placement::default());
    }
}
