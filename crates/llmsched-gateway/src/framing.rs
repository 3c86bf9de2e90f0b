//! How an HTTP/1.1 message's body is delimited, read as hyper reads it: a Transfer-Encoding that
//! codes the body, an answer that ends only when its connection closes, and a chunk's size with
//! its framing.

use hyper::header::{CONTENT_LENGTH, TRANSFER_ENCODING};
use hyper::{HeaderMap, StatusCode};

/// Whether an answer's `Transfer-Encoding` names a coding besides `chunked` (`gzip, chunked`):
/// hyper removes only the chunking, so the body would go on still coded, with nothing saying so.
pub(crate) fn coded_transfer(headers: &HeaderMap) -> bool {
    if chunked_alone(headers) {
        return false;
    }
    headers
        .get_all(TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("?").split(','))
        .map(str::trim)
        .any(|c| !c.is_empty() && !c.eq_ignore_ascii_case("chunked"))
}

/// Whether an answer's `Transfer-Encoding` is the one value `chunked` (an engine's streamed
/// answer), read without splitting the field ([`coded_transfer`] and [`ends_at_close`] read
/// it so as well).
fn chunked_alone(headers: &HeaderMap) -> bool {
    let mut values = headers.get_all(TRANSFER_ENCODING).iter();
    matches!(
        (values.next(), values.next()),
        (Some(value), None) if value.as_bytes().eq_ignore_ascii_case(b"chunked")
    )
}

/// Whether an engine's answer ends where its connection closes (RFC 9112 6.3: no
/// Content-Length, and no Transfer-Encoding ending in `chunked`): a cut is then
/// indistinguishable from the end at the HTTP level.
pub(crate) fn ends_at_close(status: StatusCode, headers: &HeaderMap) -> bool {
    if status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return false;
    }
    if chunked_alone(headers) {
        return false;
    }
    let last_coding = headers
        .get_all(TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("").split(','))
        .map(str::trim)
        .rfind(|c| !c.is_empty());
    match last_coding {
        Some(last) => !last.eq_ignore_ascii_case("chunked"),
        None => !headers.contains_key(CONTENT_LENGTH),
    }
}

/// The bytes of a chunked body's chunk of `len` data bytes (`{len:x}\r\n`, the data,
/// `\r\n`), or `len` for a body framed otherwise.
pub(crate) fn framed(len: usize, chunked: bool) -> usize {
    if !chunked {
        return len;
    }
    let digits = (usize::BITS - len.leading_zeros()).div_ceil(4).max(1) as usize;
    len + digits + 4
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;

    #[test]
    fn a_chunk_is_framed_by_its_hex_size_line_and_two_crlfs() {
        assert_eq!(framed(0, true), 5, "0\\r\\n\\r\\n");
        assert_eq!(framed(15, true), 15 + 1 + 4);
        assert_eq!(framed(16, true), 16 + 2 + 4);
        assert_eq!(framed(0x1234, true), 0x1234 + 4 + 4);
        assert_eq!(framed(16, false), 16);
        for len in [1usize, 9, 200, 4096, 70_000] {
            assert_eq!(framed(len, true), format!("{len:x}\r\n").len() + len + 2);
        }
    }

    #[test]
    fn an_answer_ends_at_its_close_only_without_a_length_or_a_final_chunked() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut map = HeaderMap::new();
            for (name, value) in pairs {
                map.append(*name, HeaderValue::from_static(value));
            }
            map
        };
        let ok = StatusCode::OK;
        assert!(ends_at_close(ok, &headers(&[])));
        assert!(!ends_at_close(ok, &headers(&[("content-length", "5")])));
        assert!(!ends_at_close(ok, &headers(&[("transfer-encoding", "chunked")])));
        assert!(!ends_at_close(ok, &headers(&[("transfer-encoding", "gzip, Chunked")])));
        assert!(ends_at_close(ok, &headers(&[("transfer-encoding", "chunked, gzip")])));
        assert!(ends_at_close(
            ok,
            &headers(&[("transfer-encoding", "gzip"), ("content-length", "5")])
        ));
        assert!(!ends_at_close(StatusCode::NO_CONTENT, &headers(&[])));
        assert!(!ends_at_close(StatusCode::NOT_MODIFIED, &headers(&[])));
    }

    #[test]
    fn a_lone_chunked_is_read_as_the_split_field_reads_it() {
        let headers = |values: &[&'static str]| {
            let mut map = HeaderMap::new();
            for value in values {
                map.append(TRANSFER_ENCODING, HeaderValue::from_static(value));
            }
            map
        };
        // The split reading of the field, as before the shortcut.
        let codings = |map: &HeaderMap| -> Vec<String> {
            map.get_all(TRANSFER_ENCODING)
                .iter()
                .flat_map(|v| v.to_str().unwrap_or("?").split(','))
                .map(|c| c.trim().to_ascii_lowercase())
                .filter(|c| !c.is_empty())
                .collect()
        };
        let ok = StatusCode::OK;
        for values in [
            &["chunked"][..],
            &["Chunked"],
            &["CHUNKED"],
            &["chunked", "chunked"],
            &["gzip", "chunked"],
            &["chunked", "gzip"],
            &["gzip, chunked"],
            &["chunked,"],
            &["chunkedx"],
            &["chunk"],
            &[""],
            &[],
        ] {
            let map = headers(values);
            let split = codings(&map);
            let alone = chunked_alone(&map);
            assert_eq!(
                alone,
                values.len() == 1 && split == ["chunked"] && !values[0].contains(',')
            );
            assert_eq!(coded_transfer(&map), split.iter().any(|c| c != "chunked"), "{values:?}");
            let at_close = match split.last() {
                Some(last) => last != "chunked",
                None => true,
            };
            assert_eq!(ends_at_close(ok, &map), at_close, "{values:?}");
        }
    }
}
