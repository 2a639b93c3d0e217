//! Bearer tokens, as the admin API and the Fleet service check them.

use std::fmt;

use ring::digest::{Digest, SHA256, digest};

/// The scheme an `authorization` value names before its token, with its separating space.
const SCHEME: &[u8] = b"Bearer ";

/// An expected token as it is checked: its SHA-256 digest, taken once when configured.
#[derive(Clone, Copy)]
pub struct Token(Digest);

impl Token {
    pub fn new(token: &str) -> Self {
        Self::of(token.as_bytes())
    }

    fn of(token: &[u8]) -> Self {
        Self(digest(&SHA256, token))
    }

    /// The token an `authorization` value presents (`Bearer <token>`, the scheme in any case
    /// as RFC 9110 §11.1 has it), digested to be checked.
    pub fn presented(authorization: Option<&[u8]>) -> Option<Self> {
        let (scheme, token) = authorization?.split_at_checked(SCHEME.len())?;
        scheme.eq_ignore_ascii_case(SCHEME).then(|| Self::of(token))
    }

    /// Whether two tokens are the same. The digests are compared without an early exit, so
    /// response timing reveals neither a matching prefix nor the expected token's length.
    pub fn matches(&self, other: &Token) -> bool {
        self.0.as_ref().iter().zip(other.0.as_ref()).fold(0u8, |differ, (a, b)| differ | (a ^ b)) == 0
    }
}

/// Never prints the token, nor its digest.
impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(***)")
    }
}

/// Whether an `authorization` value presents `expected` as its bearer token ([`Token::matches`]).
pub fn accepts(authorization: Option<&[u8]>, expected: &Token) -> bool {
    Token::presented(authorization).is_some_and(|presented| presented.matches(expected))
}

/// Whether a call presenting `presented` may proceed while `expected` are the tokens: any of
/// them, or anything while there are none.
pub fn admits(expected: &[Token], presented: Option<&Token>) -> bool {
    expected.is_empty() || presented.is_some_and(|presented| expected.iter().any(|token| presented.matches(token)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_accepted_only_whole_and_after_its_scheme() {
        let cases: [(Option<&[u8]>, bool); 9] = [
            (Some(b"Bearer s3cret"), true),
            (Some(b"Bearer s3creT"), false),
            (Some(b"Bearer s3cret2"), false),
            (Some(b"Bearer s3cre"), false),
            (Some(b"bearer s3cret"), true),
            (Some(b"BEARER s3cret"), true),
            (Some(b"Basic s3cret"), false),
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
