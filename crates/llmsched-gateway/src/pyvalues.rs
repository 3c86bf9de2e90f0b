//! Template values as Jinja on Python writes them: `{{ value }}` as Python's `str()`
//! ([`python_formatter`], [`python_str`]) and Hugging Face's `tojson` filter as Python's
//! `json.dumps` ([`tojson`]), so that a render on the native plane is the text the engine's
//! Jinja writes.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Error, ErrorKind, State, Value};

/// `{{ value }}` as Jinja on Python writes it: Python's `str()` (`None`, `True`, `['a']`).
pub fn python_formatter(
    out: &mut minijinja::Output,
    _state: &State,
    value: &Value,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined => Ok(()),
        ValueKind::String => out.write_str(value.as_str().unwrap_or("")).map_err(Error::from),
        _ => out.write_str(&python_str(value)).map_err(Error::from),
    }
}

/// Python's `str()` of a value: strings as they are, everything else its `repr()`.
pub fn python_str(value: &Value) -> String {
    match value.as_str() {
        Some(text) if value.kind() == ValueKind::String => text.to_owned(),
        _ => {
            let mut out = String::new();
            python_repr(value, &mut out);
            out
        }
    }
}

fn python_repr(value: &Value, out: &mut String) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => match f64_of(value) {
            Some(f) => out.push_str(&python_float(f, false)),
            None => {
                let _ = write!(out, "{value}");
            }
        },
        ValueKind::String => repr_str(value.as_str().unwrap_or(""), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            if let Ok(items) = value.try_iter() {
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    python_repr(&item, out);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = value.try_iter() {
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    python_repr(&key, out);
                    out.push_str(": ");
                    python_repr(&value.get_item(&key).unwrap_or_default(), out);
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr()` of a string.
fn repr_str(text: &str, out: &mut String) {
    let quote = if text.contains('\'') && !text.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// A number that is a float (not an integer), as `f64`.
fn f64_of(value: &Value) -> Option<f64> {
    if value.is_integer() {
        return None;
    }
    f64::try_from(value.clone()).ok()
}

/// Python's `repr(float)` (`json` spells the non-finite ones `NaN`, `Infinity`).
fn python_float(f: f64, json: bool) -> String {
    if f.is_nan() {
        return if json { "NaN" } else { "nan" }.into();
    }
    if f.is_infinite() {
        let text = if json { "Infinity" } else { "inf" };
        return if f < 0.0 { format!("-{text}") } else { text.into() };
    }
    let scientific = format!("{f:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if f != 0.0 && !(-4..16).contains(&exponent) {
        let sign = if exponent < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exponent.unsigned_abs());
    }
    let fixed = format!("{f}");
    if fixed.contains('.') {
        fixed
    } else {
        format!("{fixed}.0")
    }
}

/// Hugging Face's `tojson`: Python's `json.dumps(value, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, keyword or positional arguments in that order.
pub fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let positional = |i: usize| args.get(i).cloned();
    let ensure_ascii = kwargs
        .get::<Option<bool>>("ensure_ascii")?
        .or_else(|| positional(0).map(|v| v.is_true()))
        .unwrap_or(false);
    let indent = kwargs.get::<Option<Value>>("indent")?.or_else(|| positional(1));
    let separators = kwargs.get::<Option<Value>>("separators")?.or_else(|| positional(2));
    let sort_keys = kwargs
        .get::<Option<bool>>("sort_keys")?
        .or_else(|| positional(3).map(|v| v.is_true()))
        .unwrap_or(false);
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_owned()),
        Some(v) => match i64::try_from(v) {
            Ok(n) => Some(" ".repeat(n.max(0) as usize)),
            Err(_) => {
                return Err(Error::new(ErrorKind::InvalidOperation, "tojson: bad indent"));
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                    (a.as_str().unwrap_or(",").to_owned(), b.as_str().unwrap_or(":").to_owned())
                }
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let dumper = Dumper { ensure_ascii, indent, item_sep, key_sep, sort_keys };
    let mut out = String::new();
    dumper.dump(value, 0, &mut out)?;
    Ok(Value::from(out))
}

struct Dumper {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl Dumper {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    }

    fn separator(&self, level: usize, out: &mut String) {
        out.push_str(&self.item_sep);
        self.newline(level, out);
    }

    fn dump(&self, value: &Value, level: usize, out: &mut String) -> Result<(), Error> {
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => match f64_of(value) {
                Some(f) => out.push_str(&python_float(f, true)),
                None => {
                    let _ = write!(out, "{value}");
                }
            },
            ValueKind::String => self.string(value.as_str().unwrap_or(""), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                self.newline(level + 1, out);
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        self.separator(level + 1, out);
                    }
                    self.dump(item, level + 1, out)?;
                }
                self.newline(level, out);
                out.push(']');
            }
            ValueKind::Map => {
                let mut entries: Vec<(String, Value)> = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    let name = match key.kind() {
                        ValueKind::String => key.as_str().unwrap_or("").to_owned(),
                        ValueKind::None => "null".into(),
                        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).into(),
                        ValueKind::Number => match f64_of(&key) {
                            Some(f) => python_float(f, true),
                            None => key.to_string(),
                        },
                        _ => {
                            return Err(Error::new(
                                ErrorKind::InvalidOperation,
                                "tojson: keys must be str, int, float, bool or None",
                            ))
                        }
                    };
                    entries.push((name, item));
                }
                if entries.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                out.push('{');
                self.newline(level + 1, out);
                for (i, (name, item)) in entries.iter().enumerate() {
                    if i > 0 {
                        self.separator(level + 1, out);
                    }
                    self.string(name, out);
                    out.push_str(&self.key_sep);
                    self.dump(item, level + 1, out)?;
                }
                self.newline(level, out);
                out.push('}');
            }
            kind => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a value of type {kind} is not JSON serializable"),
                ))
            }
        }
        Ok(())
    }

    /// A JSON string as Python's `json` writes it.
    fn string(&self, text: &str, out: &mut String) {
        out.push('"');
        for c in text.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c if self.ensure_ascii && (c as u32) > 0x7e => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_repr() {
        for (f, text) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (1e16, "1e+16"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (123456789.25, "123456789.25"),
            (-2.0, "-2.0"),
        ] {
            assert_eq!(python_float(f, false), text);
        }
        assert_eq!(python_float(f64::NAN, true), "NaN");
        assert_eq!(python_float(f64::NEG_INFINITY, true), "-Infinity");
    }
}
