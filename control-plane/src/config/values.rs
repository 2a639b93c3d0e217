//! Scalar value types of the configuration and their YAML forms: secrets that never print,
//! humantime durations, Dynamo instance ids and CIDRs.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use serde::{Deserialize, Serialize, Serializer};

/// What every secret renders as in `config show`, the Admin API and `Debug` output.
pub const MASK: &str = "********";

/// A secret string. It serializes and debug-prints as [`MASK`], so no rendering of the
/// configuration can leak it; only [`Secret::expose`] reads it.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

/// Why a secret that reads [`MASK`] is refused.
pub(super) const MASKED_READBACK: &str =
    "is `********`, what `config show` prints in place of a secret; give the real value";

/// The mask itself is refused: a file `config show` wrote, loaded back, would otherwise make
/// every token the public string `********` and every password and key path useless.
impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = String::deserialize(deserializer)?;
        if value == MASK {
            return Err(serde::de::Error::custom(MASKED_READBACK));
        }
        Ok(Self(value))
    }
}

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({MASK})")
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(MASK)
    }
}

/// `std::time::Duration` as a humantime string (`"500ms"`, `"30s"`).
pub(super) mod duration {
    use std::fmt;
    use std::time::Duration;

    use serde::de::{Error, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&humantime::format_duration(*value))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        deserializer.deserialize_any(DurationVisitor)
    }

    struct DurationVisitor;

    impl Visitor<'_> for DurationVisitor {
        type Value = Duration;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a duration with its unit, such as \"500ms\" or \"30s\"")
        }

        fn visit_str<E: Error>(self, text: &str) -> Result<Duration, E> {
            humantime::parse_duration(text)
                .map_err(|e| E::custom(format!("invalid duration `{text}` ({e}); write e.g. \"500ms\" or \"30s\"")))
        }

        // A bare number has no unit: say which forms it may take rather than "expected a string".
        fn visit_u64<E: Error>(self, value: u64) -> Result<Duration, E> {
            Err(E::custom(format!("a duration needs its unit: write \"{value}s\" or \"{value}ms\", not {value}")))
        }

        fn visit_i64<E: Error>(self, value: i64) -> Result<Duration, E> {
            Err(E::custom(format!("a duration needs its unit, and is never negative: {value}")))
        }

        fn visit_f64<E: Error>(self, value: f64) -> Result<Duration, E> {
            Err(E::custom(format!("a duration needs its unit: write e.g. \"{value}s\", not {value}")))
        }
    }
}

/// A Dynamo instance id: a YAML integer (the etcd lease id) or a hex string (`"0x1a7f2b"` or
/// `"1a7f2b"`), as Dynamo writes either. A string is always hex, even one that looks decimal.
/// Ids are often above 2^53, so no path goes through f64.
pub(super) mod instance_id {
    use std::fmt;

    use serde::de::{Error, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &u64, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u64(*value)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
        deserializer.deserialize_any(InstanceIdVisitor)
    }

    struct InstanceIdVisitor;

    impl Visitor<'_> for InstanceIdVisitor {
        type Value = u64;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("an unsigned 64-bit integer or a hex string such as \"0x1a7f2b\"")
        }

        fn visit_u64<E: Error>(self, value: u64) -> Result<u64, E> {
            Ok(value)
        }

        fn visit_i64<E: Error>(self, value: i64) -> Result<u64, E> {
            u64::try_from(value).map_err(|_| E::custom(format!("instance_id {value} is negative")))
        }

        fn visit_f64<E: Error>(self, value: f64) -> Result<u64, E> {
            // A float here means the integer did not fit in 64 bits (or had a fraction): refuse
            // rather than round to a different worker.
            Err(E::custom(format!("instance_id {value} is not an unsigned 64-bit integer")))
        }

        fn visit_str<E: Error>(self, value: &str) -> Result<u64, E> {
            super::parse_hex_instance_id(value)
                .ok_or_else(|| E::custom(format!("instance_id `{value}` is not a 64-bit hex number")))
        }
    }
}

/// Parses Dynamo's hex form of an instance id, with or without `0x`.
pub fn parse_hex_instance_id(text: &str) -> Option<u64> {
    let digits = text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")).unwrap_or(text);
    if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(digits, 16).ok()
}

/// An IPv4 or IPv6 network, `10.0.0.0/8` or `fd00::/8`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix_len: u8,
}

impl Cidr {
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                prefix_eq(u32::from(net).into(), u32::from(ip).into(), self.prefix_len, 32)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => prefix_eq(u128::from(net), u128::from(ip), self.prefix_len, 128),
            _ => false,
        }
    }
}

fn prefix_eq(net: u128, ip: u128, prefix_len: u8, bits: u32) -> bool {
    let host_bits = bits - u32::from(prefix_len);
    (net ^ ip).checked_shr(host_bits).unwrap_or(0) == 0
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let (addr, prefix) = text
            .split_once('/')
            .ok_or_else(|| format!("`{text}` is not a CIDR; write it as address/prefix, e.g. 10.0.0.0/8"))?;
        let addr: IpAddr = addr.parse().map_err(|_| format!("`{addr}` is not an IP address"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix_len = prefix
            .parse::<u8>()
            .ok()
            .filter(|p| u32::from(*p) <= max)
            .ok_or_else(|| format!("prefix length `{prefix}` must be 0..={max}"))?;
        Ok(Self { addr, prefix_len })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}
