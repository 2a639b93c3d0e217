//! Ties one pinned dispatch's entry in the [`DispatchLedger`] to the life of its request.

use std::sync::Arc;
use std::time::Instant;

use continuum_proto::view::FleetView;

use crate::routing::picker::{DispatchId, DispatchLedger, Selection, dispatch_block_size};

/// Ends its dispatch in the ledger when dropped: when the response body completes, the request
/// is refused or fails, or the client goes away and the response is dropped unfinished.
#[derive(Debug)]
pub struct DispatchEnd {
    ledger: Arc<DispatchLedger>,
    id: DispatchId,
}

impl DispatchEnd {
    /// Records a dispatch of `prompt_tokens` pinned as `selection`.
    pub fn record(ledger: &Arc<DispatchLedger>, view: &FleetView, selection: &Selection, prompt_tokens: u64) -> Self {
        let block_size = dispatch_block_size(view, selection);
        let id = ledger.record(selection, prompt_tokens, block_size, Instant::now());
        Self { ledger: Arc::clone(ledger), id }
    }
}

impl Drop for DispatchEnd {
    fn drop(&mut self) {
        self.ledger.end(self.id, Instant::now());
    }
}
