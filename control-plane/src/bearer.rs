//! Bearer tokens, as the admin API and the Fleet service check them.

/// Whether an `authorization` value presents `expected` as its bearer token. The comparison has
/// no early exit, so response timing does not reveal a matching prefix.
pub fn accepts(authorization: Option<&[u8]>, expected: &str) -> bool {
    authorization
        .and_then(|value| value.strip_prefix(b"Bearer "))
        .is_some_and(|token| equal(token, expected.as_bytes()))
}

/// Reads every byte of the longer of the two whatever they hold, so neither a matching prefix
/// nor the expected length shows in the time it takes.
fn equal(a: &[u8], b: &[u8]) -> bool {
    let byte = |bytes: &[u8], i: usize| bytes.get(i).copied().unwrap_or(0);
    let differ = (0..a.len().max(b.len()))
        .fold(usize::from(a.len() != b.len()), |acc, i| acc | usize::from(byte(a, i) ^ byte(b, i)));
    differ == 0
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
