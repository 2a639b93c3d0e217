//! Bearer tokens, as the admin API and the Fleet service check them.

use std::fmt;

use ring::digest::{Digest, SHA256, digest};

/// An expected token as it is checked: its SHA-256 digest, taken once when configured.
#[derive(Clone, Copy)]
pub struct Token(Digest);

impl Token {
    pub fn new(token: &str) -> Self {
        Self(digest(&SHA256, token.as_bytes()))
    }
}

/// Never prints the token, nor its digest.
impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(***)")
    }
}

/// Whether an `authorization` value presents `expected` as its bearer token. The presented
/// token's digest is compared with the expected one's without an early exit, so response
/// timing reveals neither a matching prefix nor the expected token's length.
pub fn accepts(authorization: Option<&[u8]>, expected: &Token) -> bool {
    let Some(token) = authorization.and_then(|value| value.strip_prefix(b"Bearer ")) else { return false };
    let presented = digest(&SHA256, token);
    presented.as_ref().iter().zip(expected.0.as_ref()).fold(0u8, |differ, (a, b)| differ | (a ^ b)) == 0
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
            assert_eq!(
                accepts(authorization, &Token::new("s3cret")),
                accepted,
                "{:?}",
                authorization.map(String::from_utf8_lossy)
            );
        }
    }
}
