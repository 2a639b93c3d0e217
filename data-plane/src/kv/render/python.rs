//! Python's spelling of values, where a chat template's output depends on it. Templates are
//! written for Hugging Face's Python renderer, and dynamo.frontend 1.6.1 (dynamo-renderer
//! 8.0.3) spells floats, whitespace and `tojson` the Python way on top of minijinja; the
//! replica must print the same bytes or its block hashes miss the workers' cache.

use std::borrow::Cow;
use std::io;

use minijinja::value::{Kwargs, StringInput, from_args};
use minijinja::{Error, ErrorKind, Output, State, Value, escape_formatter};
use serde::Serialize;
use serde_json::ser::{CompactFormatter, Formatter, PrettyFormatter};

/// The widest `tojson(indent=n)` rendered; chat templates use 2 or 4.
pub const MAX_TOJSON_INDENT: usize = 16;

/// Python's `repr` (and `str`) of a float: the shortest digits that read back the same, in
/// positional notation for exponents -4..16 and scientific (`1e+20`, `1e-05`) outside them.
pub fn float_repr(value: f64) -> String {
    if value.is_nan() {
        return "nan".into();
    }
    if value.is_infinite() {
        return if value < 0.0 { "-inf" } else { "inf" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits as `d[.ddd]e<exp>`.
    let scientific = format!("{:e}", value.abs());
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if value.is_sign_negative() { "-" } else { "" };
    if !(-4..16).contains(&exponent) {
        let (head, tail) = digits.split_at(1);
        let mantissa = if tail.is_empty() { head.to_string() } else { format!("{head}.{tail}") };
        let exponent_sign = if exponent < 0 { '-' } else { '+' };
        return format!("{sign}{mantissa}e{exponent_sign}{:02}", exponent.unsigned_abs());
    }
    let point = exponent + 1;
    let fixed = if point <= 0 {
        format!("0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
    } else if point as usize >= digits.len() {
        format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
    } else {
        let (whole, fraction) = digits.split_at(point as usize);
        format!("{whole}.{fraction}")
    };
    format!("{sign}{fixed}")
}

/// The Python `str` of a value that is a float, `None` for everything else.
fn float_str(value: &Value) -> Option<String> {
    if !value.is_number() || value.is_integer() {
        return None;
    }
    f64::try_from(value.clone()).ok().map(float_repr)
}

/// `{{ x }}`: floats as Python prints them, everything else as minijinja does.
pub fn formatter(out: &mut Output, state: &State, value: &Value) -> Result<(), Error> {
    match float_str(value) {
        Some(text) => out.write_str(&text).map_err(Error::from),
        None => escape_formatter(out, state, value),
    }
}

/// The `string` filter, with floats as [`formatter`] prints them.
pub fn string_filter(state: &State, value: &Value) -> Result<Value, Error> {
    match float_str(value) {
        Some(text) => Ok(Value::from(text)),
        None => minijinja::filters::string(state, value),
    }
}

/// Python's whitespace: Rust's, plus the four ASCII separators U+001C..U+001F.
fn is_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `trim` without characters strips Python's whitespace.
pub fn trim_filter(value: StringInput<'_>, chars: Option<Cow<'_, str>>) -> Value {
    match chars {
        Some(chars) => minijinja::filters::trim(value, Some(chars)),
        None => {
            let trimmed = value.as_str().trim_matches(is_space).to_owned();
            value.preserve_safety(trimmed)
        }
    }
}

/// String methods where Python's differ from minijinja-contrib's pycompat (whitespace,
/// `splitlines`' line breaks, `isspace` of "", `count` of ""); every other method goes to
/// pycompat.
pub fn methods(state: &State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if let Some(text) = value.as_str() {
        let keep_safety = |part: &str| {
            if value.is_safe() { Value::from_safe_string(part.to_owned()) } else { Value::from(part) }
        };
        match method {
            "strip" | "lstrip" | "rstrip" => {
                let (chars,): (Option<&str>,) = from_args(args)?;
                if chars.is_none() {
                    let trimmed = match method {
                        "strip" => text.trim_matches(is_space),
                        "lstrip" => text.trim_start_matches(is_space),
                        _ => text.trim_end_matches(is_space),
                    };
                    return Ok(StringInput::new(state, value)?.preserve_safety(trimmed.to_owned()));
                }
            }
            "split" => {
                let (separator, max_split): (Option<&str>, Option<i64>) = from_args(args)?;
                if separator.is_none() {
                    let max_split = max_split.and_then(|n| usize::try_from(n).ok());
                    return Ok(split_whitespace(text, max_split).into_iter().map(keep_safety).collect());
                }
            }
            "splitlines" => {
                let (keep_ends,): (Option<bool>,) = from_args(args)?;
                return Ok(splitlines(text, keep_ends.unwrap_or(false)).into_iter().map(keep_safety).collect());
            }
            "isspace" => {
                let () = from_args(args)?;
                return Ok(Value::from(!text.is_empty() && text.chars().all(is_space)));
            }
            "count" => {
                let (needle,): (&str,) = from_args(args)?;
                // minijinja-contrib's `count` never ends on an empty needle (each search finds
                // it again at the same place); Python counts the places between characters.
                if needle.is_empty() {
                    return Ok(Value::from(text.chars().count() + 1));
                }
            }
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// `str.split()` with no separator: runs of whitespace split, ends ignored.
fn split_whitespace(text: &str, max_split: Option<usize>) -> Vec<&str> {
    let mut words = Vec::new();
    let mut rest = text;
    loop {
        rest = rest.trim_start_matches(is_space);
        if rest.is_empty() {
            return words;
        }
        if max_split == Some(words.len()) {
            words.push(rest);
            return words;
        }
        let end = rest.find(is_space).unwrap_or(rest.len());
        words.push(&rest[..end]);
        rest = &rest[end..];
    }
}

/// `str.splitlines()`: every Python line boundary ends a line, `\r\n` as one.
fn splitlines(text: &str, keep_ends: bool) -> Vec<&str> {
    let is_break = |c: char| {
        matches!(
            c,
            '\n' | '\r' | '\u{b}' | '\u{c}' | '\u{1c}' | '\u{1d}' | '\u{1e}' | '\u{85}' | '\u{2028}' | '\u{2029}'
        )
    };
    let mut lines = Vec::new();
    let mut start = 0;
    let mut chars = text.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        if !is_break(c) {
            continue;
        }
        let mut end = at + c.len_utf8();
        if c == '\r' && chars.peek().is_some_and(|&(_, next)| next == '\n') {
            chars.next();
            end += 1;
        }
        lines.push(&text[start..if keep_ends { end } else { at }]);
        start = end;
    }
    if start < text.len() {
        lines.push(&text[start..]);
    }
    lines
}

/// What `tojson` fails with past its cap: the render reads it as a prompt too large.
pub const TOJSON_TOO_LARGE: &str = "tojson output is larger than a prompt may be";

/// HF transformers' `tojson`: `json.dumps(x, ensure_ascii=False)` with Python's `", "` and
/// `": "` separators (or `indent=n`) and Python's floats, no HTML escaping. Written under
/// `cap` bytes: the template's fuel is charged for a filter's result only after it returns.
pub fn tojson(value: Value, kwargs: Kwargs, cap: usize) -> Result<Value, Error> {
    // Like the frontend's: other keywords (`ensure_ascii=False`, `sort_keys`) are ignored, and
    // an indent that is not a count is none.
    let indent: Option<usize> = kwargs.get("indent").ok().flatten();
    if indent.is_some_and(|n| n > MAX_TOJSON_INDENT) {
        let message = format!("tojson indent is at most {MAX_TOJSON_INDENT}");
        return Err(Error::new(ErrorKind::InvalidOperation, message));
    }
    let mut out = CappedWriter::new(cap);
    let result = match indent {
        Some(n) => {
            let indent = b" ".repeat(n);
            let formatter = PythonJson { inner: PrettyFormatter::with_indent(&indent), separators: false };
            value.serialize(&mut serde_json::Serializer::with_formatter(&mut out, formatter))
        }
        None => {
            let formatter = PythonJson { inner: CompactFormatter, separators: true };
            value.serialize(&mut serde_json::Serializer::with_formatter(&mut out, formatter))
        }
    };
    if out.overflowed {
        return Err(Error::new(ErrorKind::InvalidOperation, TOJSON_TOO_LARGE));
    }
    result.map_err(|e| Error::new(ErrorKind::BadSerialization, "cannot serialize to JSON").with_source(e))?;
    String::from_utf8(out.buf)
        .map(Value::from_safe_string)
        .map_err(|e| Error::new(ErrorKind::BadSerialization, "JSON is not UTF-8").with_source(e))
}

/// A serde_json formatter with Python's floats (`null` for the non-finite, as `json.dumps`
/// would refuse them) and, compact, Python's separators; pretty keeps the inner layout.
struct PythonJson<F> {
    inner: F,
    separators: bool,
}

impl<F: Formatter> Formatter for PythonJson<F> {
    fn write_f64<W: ?Sized + io::Write>(&mut self, writer: &mut W, value: f64) -> io::Result<()> {
        if !value.is_finite() {
            return writer.write_all(b"null");
        }
        writer.write_all(float_repr(value).as_bytes())
    }

    fn begin_array<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.inner.begin_array(writer)
    }

    fn end_array<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.inner.end_array(writer)
    }

    fn begin_array_value<W: ?Sized + io::Write>(&mut self, writer: &mut W, first: bool) -> io::Result<()> {
        match (self.separators, first) {
            (true, true) => Ok(()),
            (true, false) => writer.write_all(b", "),
            (false, _) => self.inner.begin_array_value(writer, first),
        }
    }

    fn end_array_value<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.inner.end_array_value(writer)
    }

    fn begin_object<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.inner.begin_object(writer)
    }

    fn end_object<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.inner.end_object(writer)
    }

    fn begin_object_key<W: ?Sized + io::Write>(&mut self, writer: &mut W, first: bool) -> io::Result<()> {
        match (self.separators, first) {
            (true, true) => Ok(()),
            (true, false) => writer.write_all(b", "),
            (false, _) => self.inner.begin_object_key(writer, first),
        }
    }

    fn end_object_key<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.inner.end_object_key(writer)
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        if self.separators { writer.write_all(b": ") } else { self.inner.begin_object_value(writer) }
    }

    fn end_object_value<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.inner.end_object_value(writer)
    }
}

/// Refuses output past its cap, so an adversarial template stops as soon as it overflows
/// instead of after building a huge string.
pub struct CappedWriter {
    pub buf: Vec<u8>,
    cap: usize,
    pub overflowed: bool,
}

impl CappedWriter {
    pub fn new(cap: usize) -> Self {
        Self { buf: Vec::new(), cap, overflowed: false }
    }
}

impl io::Write for CappedWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.buf.len() + data.len() > self.cap {
            self.overflowed = true;
            return Err(io::Error::other("rendered output too large"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_prints_them() {
        let cases = [
            (1.0, "1.0"),
            (1.5, "1.5"),
            (-0.0, "-0.0"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1e20, "1e+20"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456.789, "123456.789"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (-2.5e-7, "-2.5e-07"),
            (1.25e100, "1.25e+100"),
            (f64::NAN, "nan"),
            (f64::NEG_INFINITY, "-inf"),
        ];
        for (value, python) in cases {
            assert_eq!(float_repr(value), python, "{value:e}");
        }
    }

    #[test]
    fn whitespace_and_lines_split_as_in_python() {
        assert_eq!(split_whitespace("  a \u{1f}b\tc  ", None), ["a", "b", "c"]);
        assert_eq!(split_whitespace(" a b c", Some(1)), ["a", "b c"]);
        assert_eq!(splitlines("a\r\nb\u{2028}c\n", false), ["a", "b", "c"]);
        assert_eq!(splitlines("a\r\nb", true), ["a\r\n", "b"]);
        assert!(splitlines("", false).is_empty());
    }
}
