//! Ties one pinned dispatch's accounting to the life of its request: this replica's
//! [`DispatchLedger`] (read by its picker at once) and the [`DispatchReporter`] (folded by the
//! control plane into the fleet-wide backlogs every replica's picker reads).

use std::sync::Arc;
use std::time::Instant;

use continuum_proto::view::FleetView;

use crate::fleet::DispatchReporter;
use crate::routing::picker::{DispatchId, DispatchLedger, Selection, dispatch_block_size};

/// Ends its dispatch in the ledger and reports the end when dropped: when the response body
/// completes, the request is refused or fails, or the client goes away mid-response.
#[derive(Debug)]
pub struct DispatchEnd {
    ledger: Arc<DispatchLedger>,
    id: DispatchId,
    reporter: Arc<DispatchReporter>,
    /// Reported legs: the prefill rank's (if any) and the decode rank's.
    reported: [Option<u64>; 2],
    prefilled: bool,
}

impl DispatchEnd {
    /// Records a dispatch of `prompt_tokens` pinned as `selection`: its prompt on the prefill
    /// rank, its blocks on the decode rank, as the ledger counts them. `block_hashes` (the
    /// prompt's prefix chain, empty without the KV term) goes with the rank that prefills: the
    /// prefill pin, or the decode pin when the request is served aggregated.
    pub fn record(
        ledger: &Arc<DispatchLedger>,
        reporter: &Arc<DispatchReporter>,
        view: &FleetView,
        selection: &Selection,
        prompt_tokens: u64,
        block_hashes: Vec<u64>,
    ) -> Self {
        let block_size = dispatch_block_size(view, selection);
        let id = ledger.record(selection, prompt_tokens, block_size, Instant::now());
        let blocks = selection.decode_blocks(prompt_tokens, block_size);
        let (prefill, decode) = match &selection.prefill {
            Some(pin) => (
                Some(reporter.started_with_prefix(&pin.rank_key(), prompt_tokens, 0, block_hashes)),
                reporter.started(&selection.decode.rank_key(), 0, blocks),
            ),
            None => {
                let tokens = selection.uncached_prompt_tokens(prompt_tokens, block_size);
                (None, reporter.started_with_prefix(&selection.decode.rank_key(), tokens, blocks, block_hashes))
            }
        };
        let reported = [prefill, Some(decode)];
        Self { ledger: Arc::clone(ledger), id, reporter: Arc::clone(reporter), reported, prefilled: false }
    }

    /// The response began (its first token): the prompt no longer loads the rank that
    /// prefilled it. Only the first call counts.
    pub fn prefilled(&mut self) {
        if std::mem::replace(&mut self.prefilled, true) {
            return;
        }
        self.ledger.prefilled(self.id);
        for id in self.reported.iter().flatten() {
            self.reporter.prefilled(*id);
        }
    }
}

impl DispatchEnd {
    /// The ledger the dispatch is recorded in (and whose outlier record its outcome feeds).
    pub fn ledger(&self) -> &Arc<DispatchLedger> {
        &self.ledger
    }
}

impl Drop for DispatchEnd {
    fn drop(&mut self) {
        self.ledger.end(self.id, Instant::now());
        for id in self.reported.iter().flatten() {
            self.reporter.ended(*id);
        }
    }
}
