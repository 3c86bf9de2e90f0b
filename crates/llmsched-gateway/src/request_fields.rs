//! A request's header fields, read in one pass ([`RequestFields`]), and the checks of a request
//! before its body is routed: its Host, its framing and encoding, the fields of its body the
//! gateway reads itself.

use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue, CONTENT_LENGTH, TRANSFER_ENCODING};
use hyper::{HeaderMap, Method, Request};
use serde_json::Value;

use crate::framing::coded_transfer;
use crate::payload::Payload;
use crate::refusal::Refusal;
use crate::session_token;

const TENANT_HEADER: &str = "x-llmsched-tenant";

pub(crate) const PRIORITY_HEADER: &str = "x-llmsched-priority";

pub(crate) const SESSION_HEADER: &str = "x-session-id";

/// The request headers read on every completion request, as header names: a lookup by a
/// `&str` parses and lower-cases the name each time, one by a `HeaderName` does not.
pub(crate) static TENANT_HEADER_NAME: HeaderName = HeaderName::from_static(TENANT_HEADER);

pub(crate) static PRIORITY_HEADER_NAME: HeaderName = HeaderName::from_static(PRIORITY_HEADER);

pub(crate) static SESSION_HEADER_NAME: HeaderName = HeaderName::from_static(SESSION_HEADER);

pub(crate) static SESSION_TOKEN_HEADER_NAME: HeaderName =
    HeaderName::from_static(session_token::SESSION_TOKEN_HEADER);

const MAX_TOKEN_LIMIT: u64 = (1 << 31) - 1;

/// What the gateway reads of a request's head, found in one pass over its fields (a request
/// has a few): a lookup by name hashes the name and probes the map, so a field the request
/// does not have is not looked up at all, and one it has is looked up as before (its first
/// value, or all of them). Read before anything else ([`Gateway::handle`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct RequestFields {
    /// The longest field, its name, value and `": "` (`limits.max_field_bytes`).
    pub(crate) largest: usize,
    /// How many `Host` fields.
    hosts: usize,
    pub(crate) length: bool,
    transfer: bool,
    encoding: bool,
    pub(crate) authorization: bool,
    pub(crate) api_key: bool,
    pub(crate) tenant: bool,
    pub(crate) priority: bool,
    pub(crate) session: bool,
    pub(crate) token: bool,
    pub(crate) accept: bool,
}

pub(crate) static API_KEY_HEADER_NAME: HeaderName = HeaderName::from_static("x-api-key");

impl RequestFields {
    pub(crate) fn of(headers: &HeaderMap) -> RequestFields {
        let mut fields = RequestFields::default();
        for (name, value) in headers {
            fields.largest = fields.largest.max(name.as_str().len() + value.len() + 2);
            let seen = if name == hyper::header::HOST {
                fields.hosts += 1;
                continue;
            } else if name == CONTENT_LENGTH {
                &mut fields.length
            } else if name == TRANSFER_ENCODING {
                &mut fields.transfer
            } else if name == hyper::header::CONTENT_ENCODING {
                &mut fields.encoding
            } else if name == hyper::header::AUTHORIZATION {
                &mut fields.authorization
            } else if name == hyper::header::ACCEPT {
                &mut fields.accept
            } else if name == TENANT_HEADER_NAME {
                &mut fields.tenant
            } else if name == PRIORITY_HEADER_NAME {
                &mut fields.priority
            } else if name == SESSION_HEADER_NAME {
                &mut fields.session
            } else if name == SESSION_TOKEN_HEADER_NAME {
                &mut fields.token
            } else if name == API_KEY_HEADER_NAME {
                &mut fields.api_key
            } else {
                continue;
            };
            *seen = true;
        }
        fields
    }

    /// `headers.get(name)` for a field this pass found (`present`), without a lookup for one
    /// it did not.
    pub(crate) fn get<'h>(
        present: bool,
        headers: &'h HeaderMap,
        name: &HeaderName,
    ) -> Option<&'h HeaderValue> {
        if present {
            headers.get(name)
        } else {
            None
        }
    }
}

/// The sampling fields the gateway reads have the types the OpenAI API gives them; 400
/// naming the field otherwise.
pub(crate) fn check_fields(payload: &Payload<'_>) -> Result<(), Refusal> {
    let bad = |field: &'static str, what: &str| {
        Refusal::new(400, "invalid_request_error", format!("'{field}' must be {what}")).param(field)
    };
    // None: absent; Some(None): a number out of f64's range, of no type the field takes.
    let read = |field: &str| payload.value(field).map(Result::ok);
    for field in ["max_tokens", "max_completion_tokens"] {
        // The usual value, read from its text without a `Value` made of it.
        match payload.text(field).and_then(token_limit_text) {
            Some(true) => continue,
            Some(false) => {
                return Err(bad(field, &format!("an integer in 1..{MAX_TOKEN_LIMIT} or null")))
            }
            None => {}
        }
        match read(field) {
            None | Some(Some(Value::Null)) => {}
            Some(Some(Value::Number(n)))
                if n.as_u64().is_some_and(|n| (1..=MAX_TOKEN_LIMIT).contains(&n)) => {}
            Some(_) => {
                return Err(bad(field, &format!("an integer in 1..{MAX_TOKEN_LIMIT} or null")))
            }
        }
    }
    match read("stop") {
        None | Some(Some(Value::Null | Value::String(_))) => {}
        Some(Some(Value::Array(items))) if items.iter().all(Value::is_string) => {}
        Some(_) => return Err(bad("stop", "a string, a list of strings or null")),
    }
    // The usual values, read from their text (a raw value's text is checked JSON: no
    // space around it).
    let literal = |field: &str| matches!(payload.text(field), Some("true" | "false" | "null"));
    match read("stream") {
        _ if literal("stream") => {}
        None | Some(Some(Value::Null | Value::Bool(_))) => {}
        Some(_) => return Err(bad("stream", "true, false or null")),
    }
    match read("stream_options") {
        None | Some(Some(Value::Null | Value::Object(_))) => {}
        Some(_) => return Err(bad("stream_options", "an object or null")),
    }
    match read("cache_salt") {
        None | Some(Some(Value::Null)) => {}
        // vLLM refuses an empty salt.
        Some(Some(Value::String(salt))) if !salt.is_empty() => {}
        Some(_) => return Err(bad("cache_salt", "a non-empty string or null")),
    }
    Ok(())
}

/// Whether a `max_tokens` (or `max_completion_tokens`) field of text `text`, a checked JSON
/// value, is an integer in `1..=MAX_TOKEN_LIMIT` or null, read from the text when it is
/// `null` or digits only (None for any other text, which is read as a `Value`). Digits only
/// are an integer as serde_json reads them: a `u64` when it fits, else a float (no `u64`,
/// refused as one past the limit is).
fn token_limit_text(text: &str) -> Option<bool> {
    if text == "null" {
        return Some(true);
    }
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(text.parse::<u64>().is_ok_and(|n| (1..=MAX_TOKEN_LIMIT).contains(&n)))
}

/// A 400 for a request without its one Host header (RFC 9112 3.2: an HTTP/1.1 request
/// names exactly one; any request at most one), as the Python plane's parser answers it.
pub(crate) fn host_refusal(request: &Request<Incoming>, fields: &RequestFields) -> Option<Refusal> {
    let hosts = fields.hosts;
    let missing = hosts == 0 && request.version() == hyper::Version::HTTP_11;
    (hosts > 1 || missing).then(|| {
        Refusal::new(400, "invalid_request_error", "the request needs exactly one Host header")
    })
}

/// A 415 for a request to a path served with a method it takes (`method`: HEAD read as GET)
/// whose body was sent with a Content-Encoding other than identity: bodies are taken as sent,
/// never decoded (as vLLM takes them), so a compressed one is refused, naming the encoding,
/// before it is read (a compressed body would read as "not JSON", a plain one labelled
/// compressed as JSON). As the Python plane answers it; an unknown path or method still gets
/// its 404 or 405.
pub(crate) fn encoding_refusal(
    method: &Method,
    path: &str,
    headers: &HeaderMap,
    fields: &RequestFields,
) -> Option<Refusal> {
    let served = match *method {
        Method::GET => matches!(path, "/health" | "/ready" | "/metrics" | "/v1/models"),
        Method::POST => {
            matches!(path, "/v1/completions" | "/v1/chat/completions" | "/v1/responses")
        }
        _ => false,
    };
    if !served && !path.starts_with("/admin/") && path != "/v1/responses/" {
        return None;
    }
    if fields.transfer && coded_transfer(headers) {
        // hyper removes only the chunking: the body would be read still coded (gzip).
        let codings: Vec<String> = headers
            .get_all(TRANSFER_ENCODING)
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .collect();
        return Some(Refusal {
            close: true,
            ..Refusal::new(
                501,
                "invalid_request_error",
                format!(
                    "Transfer-Encoding '{}' is not supported: send the body chunked or with a \
                     Content-Length",
                    codings.join(", ")
                ),
            )
        });
    }
    if !fields.encoding {
        return None;
    }
    let encoding = headers
        .get_all(hyper::header::CONTENT_ENCODING)
        .iter()
        .find(|value| !value.as_bytes().trim_ascii().eq_ignore_ascii_case(b"identity"))?;
    let shown = String::from_utf8_lossy(encoding.as_bytes());
    Some(Refusal {
        close: true,
        ..Refusal::new(
            415,
            "invalid_request_error",
            format!("Content-Encoding '{shown}' is not supported: send the body uncompressed"),
        )
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use hyper::StatusCode;

    /// Header fields the gateway reads, their near misses, and others, each with values that
    /// read differently.
    const FIELD_NAMES: [&str; 16] = [
        "host",
        "content-length",
        "transfer-encoding",
        "content-encoding",
        "content-type",
        "authorization",
        "accept",
        "accept-encoding",
        "x-llmsched-tenant",
        "x-llmsched-priority",
        "x-session-id",
        "x-session-token",
        "x-session-i",
        "x-api-key",
        "x-api-keys",
        "date",
    ];

    pub(crate) const FIELD_VALUES: [&[u8]; 14] = [
        b"",
        b"5",
        b"chunked",
        b"Chunked",
        b"gzip, chunked",
        b"chunked, gzip",
        b" , ",
        b"text/event-stream",
        b"text/event-stream; charset=utf-8",
        b"TEXT/EVENT-STREAM",
        b"application/json",
        b"\xfftext/event-stream",
        b"identity",
        b"a-rather-long-value-that-makes-the-field-the-largest-of-the-head",
    ];

    pub(crate) fn head_of(fields: &[(usize, usize)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for &(name, value) in fields {
            let value = HeaderValue::from_bytes(FIELD_VALUES[value % FIELD_VALUES.len()]).unwrap();
            map.append(HeaderName::from_static(FIELD_NAMES[name % FIELD_NAMES.len()]), value);
        }
        map
    }

    /// Whether `max_tokens` of text `text` passes `check_fields` as it read it before
    /// `token_limit_text` (as a `Value`).
    fn token_limit_before(text: &str) -> bool {
        match serde_json::from_str::<Value>(text).ok() {
            Some(Value::Null) => true,
            Some(Value::Number(n)) => {
                n.as_u64().is_some_and(|n| (1..=MAX_TOKEN_LIMIT).contains(&n))
            }
            _ => false,
        }
    }

    #[test]
    fn token_limits_read_from_their_text_as_from_a_value() {
        let texts = [
            "null",
            "0",
            "1",
            "7",
            "16",
            "2147483647",
            "2147483648",
            "4294967296",
            "18446744073709551615",
            "18446744073709551616",
            "99999999999999999999999",
            "1.0",
            "1e3",
            "-1",
            "-0",
            "0.5",
            "true",
            "false",
            "\"16\"",
            "[16]",
            "{}",
        ];
        let long = "9".repeat(400);
        for text in texts.iter().copied().chain([long.as_str()]) {
            let fast = token_limit_text(text);
            if let Some(fast) = fast {
                assert_eq!(fast, token_limit_before(text), "{text}");
            }
            // Through `check_fields`, fast or not, as a `Value` read it.
            for field in ["max_tokens", "max_completion_tokens"] {
                let body = format!("{{\"{field}\": {text}}}");
                let Ok(payload) = Payload::parse(body.as_bytes()) else {
                    assert!(serde_json::from_str::<Value>(&body).is_err(), "{body}");
                    continue;
                };
                let refused = check_fields(&payload).err().map(|r| (r.status, r.message));
                let before = (!token_limit_before(text)).then(|| {
                    let what = format!("an integer in 1..{MAX_TOKEN_LIMIT} or null");
                    (StatusCode::BAD_REQUEST, format!("'{field}' must be {what}"))
                });
                assert_eq!(refused, before, "{body}");
            }
        }
        assert_eq!(token_limit_text("16"), Some(true));
        assert_eq!(token_limit_text("1e3"), None);
        // The literals `stream` takes, read from the text too; any other as before.
        for (text, ok) in [("true", true), ("false", true), ("null", true), ("1", false)] {
            let body = format!("{{\"stream\": {text}}}");
            let payload = Payload::parse(body.as_bytes()).unwrap();
            assert_eq!(check_fields(&payload).is_ok(), ok, "{body}");
        }
    }

    proptest::proptest! {
        /// One pass over a request's fields finds what the lookups by name found.
        #[test]
        fn the_request_fields_read_as_the_lookups_did(
            fields in proptest::collection::vec((0usize..16, 0usize..14), 0..10),
        ) {
            let headers = head_of(&fields);
            let read = RequestFields::of(&headers);
            let largest =
                headers.iter().map(|(n, v)| n.as_str().len() + v.len() + 2).max().unwrap_or(0);
            proptest::prop_assert_eq!(read.largest, largest);
            proptest::prop_assert_eq!(
                read.hosts,
                headers.get_all(hyper::header::HOST).iter().count()
            );
            for (present, name) in [
                (read.length, &CONTENT_LENGTH),
                (read.transfer, &TRANSFER_ENCODING),
                (read.encoding, &hyper::header::CONTENT_ENCODING),
                (read.authorization, &hyper::header::AUTHORIZATION),
                (read.accept, &hyper::header::ACCEPT),
                (read.tenant, &TENANT_HEADER_NAME),
                (read.priority, &PRIORITY_HEADER_NAME),
                (read.session, &SESSION_HEADER_NAME),
                (read.token, &SESSION_TOKEN_HEADER_NAME),
                (read.api_key, &API_KEY_HEADER_NAME),
            ] {
                proptest::prop_assert_eq!(
                    RequestFields::get(present, &headers, name),
                    headers.get(name),
                    "{}",
                    name
                );
            }
            for method in [Method::GET, Method::POST, Method::PUT] {
                for path in ["/v1/completions", "/metrics", "/admin/", "/other"] {
                    let now = encoding_refusal(&method, path, &headers, &read);
                    let all = RequestFields { transfer: true, encoding: true, ..read };
                    let before = encoding_refusal(&method, path, &headers, &all);
                    proptest::prop_assert_eq!(
                        now.map(|r| (r.status, r.message)),
                        before.map(|r| (r.status, r.message))
                    );
                }
            }
        }
    }
}
