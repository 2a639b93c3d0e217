//! Dynamo 1.6.1 block hashes (`dynamo-kv-hashing`'s `Request::block_hashes`), computed here so
//! the router can match the `tokens_hash` that workers publish in their kv-events.
//!
//! A block hash is XXH3-64 over the little-endian bytes of one complete block of u32 token ids,
//! seeded with a per-request salt hash: 1337, plus XXH3-64(lora_name, seed 0), plus
//! XXH3-64(cache_salt, seed 1), all wrapping, an empty name or salt counting as absent. A trailing
//! partial block is never hashed: no worker has published it.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Dynamo's chain seed: the salt hash of a request with neither a LoRA nor a cache salt.
pub const CHAIN_SEED: u64 = 1337;
pub use continuum_proto::model::{MAX_BLOCK_SIZE, MIN_BLOCK_SIZE};
/// Distinct block sizes hashed per model (workers of one model may disagree during a rollout).
pub const MAX_BLOCK_SIZES_PER_MODEL: usize = 2;

/// A `kv_cache_block_size` within `MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockSize(u32);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockSizeError {
    #[error(
        "kv_cache_block_size {0} is outside {MIN_BLOCK_SIZE}..={MAX_BLOCK_SIZE}; the model is scored without KV overlap"
    )]
    OutOfRange(u32),
}

impl BlockSize {
    pub fn new(size: u32) -> Result<Self, BlockSizeError> {
        if (MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&size) {
            Ok(Self(size))
        } else {
            Err(BlockSizeError::OutOfRange(size))
        }
    }

    pub fn get(self) -> u32 {
        self.0
    }

    fn tokens(self) -> usize {
        // u32 always fits usize on the 32- and 64-bit targets the router builds for.
        usize::try_from(self.0).unwrap_or(usize::MAX)
    }
}

/// The per-request seed every block hash of the request uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SaltHash(u64);

impl SaltHash {
    pub fn new(cache_salt: Option<&str>, lora_name: Option<&str>) -> Self {
        let mut seed = CHAIN_SEED;
        if let Some(name) = lora_name.filter(|n| !n.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(name.as_bytes(), 0));
        }
        if let Some(salt) = cache_salt.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), 1));
        }
        Self(seed)
    }

    pub fn get(self) -> u64 {
        self.0
    }

    /// The seed, when the request asked for a cache of its own (a salt, or a LoRA): what it
    /// shares with other requests, such as encoded prompt pieces, it shares only with requests
    /// of the same seed.
    pub fn isolation(self) -> Option<u64> {
        (self != Self::default()).then_some(self.0)
    }
}

impl Default for SaltHash {
    fn default() -> Self {
        Self(CHAIN_SEED)
    }
}

/// One block's hash: what workers publish as `tokens_hash` (Dynamo's `LocalBlockHash`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LocalBlockHash(pub u64);

/// The hash of every complete `block_size` window of `tokens`, in order.
pub fn block_hashes(tokens: &[u32], block_size: BlockSize, salt: SaltHash) -> Vec<LocalBlockHash> {
    let chunks = tokens.chunks_exact(block_size.tokens());
    let mut hashes = Vec::with_capacity(chunks.len());
    let mut bytes = Vec::with_capacity(block_size.tokens() * 4);
    for block in chunks {
        bytes.clear();
        bytes.extend(block.iter().flat_map(|token| token.to_le_bytes()));
        hashes.push(LocalBlockHash(xxh3_64_with_seed(&bytes, salt.get())));
    }
    hashes
}

#[cfg(test)]
mod tests {
    use dynamo_kv_hashing::Request;
    use proptest::prelude::*;

    use super::*;

    /// The oracle: upstream's own `Request::block_hashes`, which accepts any positive block size.
    fn upstream(tokens: &[u32], block_size: u32, salt: Option<&str>, lora: Option<&str>) -> Vec<u64> {
        Request::builder()
            .tokens(tokens.to_vec())
            .salt(salt.map(str::to_string))
            .lora_name(lora.map(str::to_string))
            .build()
            .expect("a request without multimodal runs builds")
            .block_hashes(block_size)
            .expect("hashing tokens cannot fail")
    }

    fn ours(tokens: &[u32], block_size: u32, salt: Option<&str>, lora: Option<&str>) -> Vec<u64> {
        let size = BlockSize::new(block_size).expect("the strategy draws valid sizes");
        block_hashes(tokens, size, SaltHash::new(salt, lora)).into_iter().map(|h| h.0).collect()
    }

    /// The oracle the property below compares against gives dynamo-tokens' own published
    /// vectors (block size 4, below the router's minimum, so only the oracle takes it), and
    /// ours is the same XXH3 of each block's little-endian bytes under the salt's seed.
    #[test]
    fn known_blocks_match_dynamo() {
        let bytes = |tokens: &[u32]| tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<_>>();
        assert_eq!(xxh3_64_with_seed(&bytes(&[1, 2, 3, 4]), CHAIN_SEED), 14_643_705_804_678_351_452);
        assert_eq!(xxh3_64_with_seed(&bytes(&[5, 6, 7, 8]), CHAIN_SEED), 16_777_012_769_546_811_212);
        assert_eq!(
            upstream(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4, None, None),
            [14_643_705_804_678_351_452, 16_777_012_769_546_811_212]
        );
        let tokens: Vec<u32> = (100..140).collect();
        let salt = SaltHash::new(Some("tenant"), None);
        let seed = CHAIN_SEED.wrapping_add(xxh3_64_with_seed(b"tenant", 1));
        let by_hand: Vec<u64> = tokens.chunks_exact(16).map(|block| xxh3_64_with_seed(&bytes(block), seed)).collect();
        let ours: Vec<u64> =
            block_hashes(&tokens, BlockSize::new(16).unwrap(), salt).into_iter().map(|h| h.0).collect();
        assert_eq!((ours.len(), &ours), (2, &by_hand), "two whole blocks, the partial third unhashed");
    }

    #[test]
    fn only_complete_blocks_are_hashed() {
        let size = BlockSize::new(16).unwrap();
        let tokens: Vec<u32> = (0..47).collect();
        assert_eq!(block_hashes(&tokens, size, SaltHash::default()).len(), 2);
        assert!(block_hashes(&tokens[..15], size, SaltHash::default()).is_empty());
        assert!(block_hashes(&[], size, SaltHash::default()).is_empty());
    }

    #[test]
    fn empty_salt_and_lora_count_as_absent() {
        assert_eq!(SaltHash::new(Some(""), Some("")), SaltHash::default());
        assert_ne!(SaltHash::new(Some("a"), None), SaltHash::new(None, Some("a")));
    }

    #[test]
    fn block_sizes_are_bounded() {
        assert_eq!(BlockSize::new(15), Err(BlockSizeError::OutOfRange(15)));
        assert_eq!(BlockSize::new(65_537), Err(BlockSizeError::OutOfRange(65_537)));
        assert!(BlockSize::new(16).is_ok() && BlockSize::new(65_536).is_ok());
    }

    fn label() -> impl Strategy<Value = Option<String>> {
        prop_oneof![
            Just(None),
            Just(Some(String::new())),
            "[a-z0-9/._-]{1,24}".prop_map(Some),
            any::<String>().prop_map(Some)
        ]
    }

    proptest! {
        #[test]
        fn block_hashes_match_upstream(
            tokens in prop::collection::vec(any::<u32>(), 0..600),
            block_size in prop_oneof![16u32..=80, Just(256), Just(65_536)],
            salt in label(),
            lora in label(),
        ) {
            let (salt, lora) = (salt.as_deref(), lora.as_deref());
            prop_assert_eq!(ours(&tokens, block_size, salt, lora), upstream(&tokens, block_size, salt, lora));
        }
    }
}
