//! Bearer tokens, as the admin API and the Fleet service check them.

use ring::digest::{SHA256, digest};

/// Whether an `authorization` value presents `expected` as its bearer token. Their SHA-256
/// digests are compared without an early exit, so response timing reveals neither a matching
/// prefix nor the expected token's length.
pub fn accepts(authorization: Option<&[u8]>, expected: &str) -> bool {
    let Some(token) = authorization.and_then(|value| value.strip_prefix(b"Bearer ")) else { return false };
    let (presented, expected) = (digest(&SHA256, token), digest(&SHA256, expected.as_bytes()));
    presented.as_ref().iter().zip(expected.as_ref()).fold(0u8, |differ, (a, b)| differ | (a ^ b)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_accepted_only_whole_and_after_its_scheme() {
        let cases: [(Option<&[u8]>, bool); 7] = [
            (Some(b"Bearer s3cret"), true),
            (Some(b"Bearer s3creT"), false),
            (Some(b"Bearer s3cret2"), false),
            (Some(b"Bearer s3cre"), false),
            (Some(b"bearer s3cret"), false),
            (Some(b"s3cret"), false),
            (None, false),
        ];
        for (authorization, accepted) in cases {
            assert_eq!(accepts(authorization, "s3cret"), accepted, "{:?}", authorization.map(String::from_utf8_lossy));
        }
    }
}
