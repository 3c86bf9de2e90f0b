//! The HTTP/1.1 wire format of the engine side ([`pool`](crate::pool)): the answer's head,
//! parsed with `httparse`, and its body's framing, decoded incrementally.
//!
//! Model: bytes read from the engine accumulate in one buffer. [`parse_head`] takes the head
//! off its front once it is complete (skipping interim `1xx` answers) and tells how the body is
//! framed: a `Content-Length`, chunked, or everything up to the close. A [`Decoder`] then takes
//! the body's data off the buffer's front as it arrives, joining the data of every chunk the
//! buffer holds into one piece (an SSE stream's last events and the chunked body's end usually
//! arrive in one read and go out as one frame), and leaves what follows the body's end in the
//! buffer. Chunk extensions are skipped; trailers are read and dropped. Anything malformed is a
//! [`Malformed`] error, never a panic: the connection is then closed.
//!
//! Decisions beyond RFC 9112: line ends must be CRLF in the chunked framing (engines send
//! them; a bare LF is malformed); a chunk size has at most 15 hex digits; a head is at most
//! [`MAX_HEAD`] bytes with at most [`MAX_HEADERS`] fields.

use bytes::{Buf, Bytes, BytesMut};
use hyper::header::{HeaderName, HeaderValue};
use hyper::{HeaderMap, StatusCode};

/// Bytes of an answer's head at most (status line and fields).
pub const MAX_HEAD: usize = 64 << 10;
/// Header fields of an answer at most.
pub const MAX_HEADERS: usize = 64;

/// Why an answer could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed(pub &'static str);

impl std::fmt::Display for Malformed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "malformed answer: {}", self.0)
    }
}

impl std::error::Error for Malformed {}

/// How an answer's body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// After this many bytes.
    Length(u64),
    /// With the chunked encoding's last chunk.
    Chunked,
    /// When the engine closes the connection (which then cannot be reused).
    Close,
}

/// An answer's head.
#[derive(Debug)]
pub struct Head {
    /// The status (never `1xx`).
    pub status: StatusCode,
    /// The header fields as sent, hop-by-hop ones included.
    pub headers: HeaderMap,
    /// How the body ends.
    pub framing: Framing,
    /// Whether the connection can carry another request once the body has been read.
    pub keep_alive: bool,
}

/// The head at the front of `buf`, and how many bytes it took (interim `1xx` answers before it
/// included); `Ok(None)` while it is incomplete.
pub fn parse_head(buf: &[u8]) -> Result<Option<(Head, usize)>, Malformed> {
    let mut offset = 0;
    loop {
        let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut answer = httparse::Response::new(&mut fields);
        let used = match answer.parse(&buf[offset..]) {
            Ok(httparse::Status::Complete(used)) => used,
            Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => {
                return Err(Malformed("the head is too large"))
            }
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(httparse::Error::TooManyHeaders) => {
                return Err(Malformed("too many header fields"))
            }
            Err(_) => return Err(Malformed("not an HTTP/1.1 head")),
        };
        let code = answer.code.unwrap_or(0);
        offset += used;
        if offset > MAX_HEAD {
            return Err(Malformed("the head is too large"));
        }
        if code == 101 {
            return Err(Malformed("a protocol switch was not asked for"));
        }
        if (100..200).contains(&code) {
            continue;
        }
        let status = StatusCode::from_u16(code).map_err(|_| Malformed("an invalid status"))?;
        let mut headers = HeaderMap::with_capacity(answer.headers.len());
        let mut length: Option<u64> = None;
        let mut chunked = None;
        let (mut close, mut keep) = (false, false);
        for field in answer.headers.iter() {
            let name = HeaderName::from_bytes(field.name.as_bytes())
                .map_err(|_| Malformed("an invalid header name"))?;
            let value = HeaderValue::from_bytes(field.value)
                .map_err(|_| Malformed("an invalid header value"))?;
            if name == hyper::header::CONTENT_LENGTH {
                let n = parse_length(field.value)?;
                if length.is_some_and(|m| m != n) {
                    return Err(Malformed("conflicting Content-Length fields"));
                }
                length = Some(n);
            } else if name == hyper::header::TRANSFER_ENCODING {
                // The last coding decides (RFC 9112 6.1); each field's last one counts.
                let last = field.value.rsplit(|b| *b == b',').next().unwrap_or(b"");
                chunked = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
            } else if name == hyper::header::CONNECTION {
                for token in field.value.split(|b| *b == b',') {
                    let token = token.trim_ascii();
                    close |= token.eq_ignore_ascii_case(b"close");
                    keep |= token.eq_ignore_ascii_case(b"keep-alive");
                }
            }
            headers.append(name, value);
        }
        let framing = match chunked {
            Some(true) => Framing::Chunked,
            Some(false) => Framing::Close,
            None if code == 204 || code == 304 => Framing::Length(0),
            None => length.map_or(Framing::Close, Framing::Length),
        };
        let version_keeps = if answer.version == Some(1) { !close } else { keep && !close };
        let keep_alive = version_keeps && framing != Framing::Close;
        return Ok(Some((Head { status, headers, framing, keep_alive }, offset)));
    }
}

fn parse_length(value: &[u8]) -> Result<u64, Malformed> {
    let digits = value.trim_ascii();
    if digits.is_empty() || digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
        return Err(Malformed("an invalid Content-Length"));
    }
    Ok(digits.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0')))
}

/// Where a chunked body's decoding stands (one state per framing byte it waits for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Reading a chunk size: the value so far and its digits.
    Size(u64, u8),
    /// Skipping a chunk extension.
    Extension(u64),
    /// After the size line's CR.
    SizeLf(u64),
    /// Inside a chunk's data: bytes left.
    Data(u64),
    DataCr,
    DataLf,
    /// At the start of a trailer line (or of the final empty line).
    TrailerStart,
    /// Skipping a trailer field.
    Trailer,
    TrailerLf,
    /// After the final empty line's CR.
    EndLf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Length(u64),
    Close,
    Chunked(Chunk),
    Done,
}

/// Takes a body's data off the front of the read buffer; see the module's docs.
#[derive(Debug)]
pub struct Decoder {
    state: State,
}

impl Decoder {
    /// A decoder for a body framed as `framing`.
    pub fn new(framing: Framing) -> Decoder {
        let state = match framing {
            Framing::Length(0) => State::Done,
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::Chunked(Chunk::Size(0, 0)),
            Framing::Close => State::Close,
        };
        Decoder { state }
    }

    /// Whether the body has ended.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Bytes of the body still to come, where the framing says.
    pub fn remaining(&self) -> Option<u64> {
        match self.state {
            State::Length(n) => Some(n),
            State::Done => Some(0),
            _ => None,
        }
    }

    /// The body's data at the front of `buf` (None: none there yet), taken off it with the
    /// framing that went with it; [`Decoder::is_done`] tells whether the end came with it.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Bytes>, Malformed> {
        let mut out: Option<BytesMut> = None;
        while !buf.is_empty() {
            match self.state {
                State::Done => break,
                State::Close => join(&mut out, buf.split()),
                State::Length(left) => {
                    let n = left.min(buf.len() as u64);
                    join(&mut out, buf.split_to(n as usize));
                    self.state = if n == left { State::Done } else { State::Length(left - n) };
                }
                State::Chunked(Chunk::Data(left)) => {
                    let n = left.min(buf.len() as u64);
                    join(&mut out, buf.split_to(n as usize));
                    self.state = State::Chunked(if n == left {
                        Chunk::DataCr
                    } else {
                        Chunk::Data(left - n)
                    });
                }
                State::Chunked(chunk) => {
                    let byte = buf[0];
                    buf.advance(1);
                    self.state = match step(chunk, byte)? {
                        Some(next) => State::Chunked(next),
                        None => State::Done,
                    };
                }
            }
        }
        Ok(out.map(BytesMut::freeze))
    }

    /// The connection closed: the end of a body framed by it, an error for any other.
    pub fn closed(&mut self) -> Result<(), Malformed> {
        match self.state {
            State::Close | State::Done => {
                self.state = State::Done;
                Ok(())
            }
            _ => Err(Malformed("the connection closed before the body's end")),
        }
    }
}

fn join(out: &mut Option<BytesMut>, piece: BytesMut) {
    match out {
        None => *out = Some(piece),
        // Copies unless the pieces are adjacent (they are not in a chunked body).
        Some(joined) => joined.unsplit(piece),
    }
}

/// A chunked body's next state after one framing byte (None: the body's end).
fn step(chunk: Chunk, byte: u8) -> Result<Option<Chunk>, Malformed> {
    let bad = |why| Err(Malformed(why));
    let next = match (chunk, byte) {
        (Chunk::Size(n, digits), _) if byte.is_ascii_hexdigit() => {
            if digits >= 15 {
                return bad("a chunk size is too large");
            }
            let digit = (byte as char).to_digit(16).unwrap_or(0);
            Chunk::Size(n * 16 + u64::from(digit), digits + 1)
        }
        (Chunk::Size(_, 0), _) => return bad("a chunk size is missing"),
        (Chunk::Size(n, _), b';' | b' ' | b'\t') => Chunk::Extension(n),
        (Chunk::Size(n, _) | Chunk::Extension(n), b'\r') => Chunk::SizeLf(n),
        (Chunk::Size(..), _) => return bad("an invalid chunk size"),
        (Chunk::Extension(_), b'\n') => return bad("a bare LF in a chunk extension"),
        (Chunk::Extension(n), _) => Chunk::Extension(n),
        (Chunk::SizeLf(0), b'\n') => Chunk::TrailerStart,
        (Chunk::SizeLf(n), b'\n') => Chunk::Data(n),
        (Chunk::DataCr, b'\r') => Chunk::DataLf,
        (Chunk::DataCr, _) => return bad("a chunk is longer than its size"),
        (Chunk::DataLf | Chunk::TrailerLf, b'\n') => {
            if chunk == Chunk::DataLf {
                Chunk::Size(0, 0)
            } else {
                Chunk::TrailerStart
            }
        }
        (Chunk::TrailerStart, b'\r') => Chunk::EndLf,
        (Chunk::Trailer, b'\r') => Chunk::TrailerLf,
        (Chunk::TrailerStart | Chunk::Trailer, b'\n') => return bad("a bare LF in the trailers"),
        (Chunk::TrailerStart | Chunk::Trailer, _) => Chunk::Trailer,
        (Chunk::EndLf, b'\n') => return Ok(None),
        (Chunk::SizeLf(_) | Chunk::DataLf | Chunk::TrailerLf | Chunk::EndLf, _) => {
            return bad("a CR without its LF")
        }
        // Data is taken in bulk by `Decoder::decode`, never a byte at a time.
        (Chunk::Data(_), _) => return bad("data where framing was expected"),
    };
    Ok(Some(next))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `parts` one after another, decoding after each; the data, whether it ended, and
    /// what was left after the end.
    fn feed(framing: Framing, parts: &[&[u8]]) -> Result<(Vec<u8>, bool, Vec<u8>), Malformed> {
        let mut decoder = Decoder::new(framing);
        let mut buf = BytesMut::new();
        let mut data = Vec::new();
        for part in parts {
            buf.extend_from_slice(part);
            if let Some(piece) = decoder.decode(&mut buf)? {
                assert!(!piece.is_empty(), "an empty piece");
                data.extend_from_slice(&piece);
            }
        }
        Ok((data, decoder.is_done(), buf.to_vec()))
    }

    /// Every way of cutting `wire` in two, and byte by byte, gives `expected`.
    fn at_every_boundary(framing: Framing, wire: &[u8], expected: &[u8], rest: &[u8]) {
        for cut in 0..=wire.len() {
            let got = feed(framing, &[&wire[..cut], &wire[cut..]]).unwrap();
            assert_eq!(got, (expected.to_vec(), true, rest.to_vec()), "cut at {cut}");
        }
        let bytes: Vec<&[u8]> = wire.chunks(1).collect();
        assert_eq!(feed(framing, &bytes).unwrap(), (expected.to_vec(), true, rest.to_vec()));
    }

    #[test]
    fn chunked_bodies_split_anywhere() {
        let wire = b"5\r\nhello\r\n7;name=value;x\r\n, world\r\n0\r\n\r\nNEXT";
        at_every_boundary(Framing::Chunked, wire, b"hello, world", b"NEXT");
    }

    #[test]
    fn chunked_trailers_are_read_and_dropped() {
        let wire = b"A\r\n0123456789\r\n0\r\nx-trailer: 1\r\nx-other: two\r\n\r\n";
        at_every_boundary(Framing::Chunked, wire, b"0123456789", b"");
    }

    #[test]
    fn chunk_sizes_are_hex_of_either_case() {
        let data = vec![b'x'; 0x1af];
        let mut wire = b"1aF\r\n".to_vec();
        wire.extend_from_slice(&data);
        wire.extend_from_slice(b"\r\n0\r\n\r\n");
        at_every_boundary(Framing::Chunked, &wire, &data, b"");
    }

    #[test]
    fn chunks_in_one_read_come_out_as_one_piece() {
        let mut decoder = Decoder::new(Framing::Chunked);
        let mut buf = BytesMut::from(&b"3\r\nabc\r\n3\r\ndef\r\n0\r\n\r\n"[..]);
        assert_eq!(decoder.decode(&mut buf).unwrap().as_deref(), Some(&b"abcdef"[..]));
        assert!(decoder.is_done());
        assert!(buf.is_empty());
        assert_eq!(decoder.decode(&mut buf).unwrap(), None);
    }

    #[test]
    fn length_bodies_split_anywhere() {
        at_every_boundary(Framing::Length(11), b"hello worldHTTP/1.1", b"hello world", b"HTTP/1.1");
        at_every_boundary(Framing::Length(0), b"left", b"", b"left");
        let mut decoder = Decoder::new(Framing::Length(5));
        assert_eq!(decoder.remaining(), Some(5));
        assert_eq!(decoder.closed(), Err(Malformed("the connection closed before the body's end")));
    }

    #[test]
    fn close_delimited_bodies_end_at_the_close() {
        let (data, done, _) = feed(Framing::Close, &[b"abc", b"def"]).unwrap();
        assert_eq!((data.as_slice(), done), (&b"abcdef"[..], false));
        let mut decoder = Decoder::new(Framing::Close);
        assert_eq!(decoder.remaining(), None);
        assert_eq!(decoder.closed(), Ok(()));
        assert!(decoder.is_done());
    }

    #[test]
    fn a_chunked_body_cut_short_is_an_error_at_the_close() {
        for wire in [&b""[..], b"5\r\nhel", b"5\r\nhello\r\n", b"0\r\n", b"0\r\n\r"] {
            let mut decoder = Decoder::new(Framing::Chunked);
            let mut buf = BytesMut::from(wire);
            decoder.decode(&mut buf).unwrap();
            assert!(!decoder.is_done());
            assert!(decoder.closed().is_err(), "{wire:?}");
        }
    }

    #[test]
    fn malformed_chunked_bodies_are_errors() {
        let cases: &[&[u8]] = &[
            b"\r\n",                 // no size
            b"g\r\n",                // not hex
            b"-1\r\n",               // not hex
            b"5\nhello\r\n",         // bare LF after the size
            b"5\r\nhello!\r\n",      // longer than its size
            b"5\r\nhello\r\r",       // CR without LF
            b"5\r\nhello\n",         // bare LF after the data
            b"1000000000000000\r\n", // 16 hex digits
            b"5;ext\nhello",         // bare LF in an extension
            b"0\r\nx\n",             // bare LF in a trailer
            b"0\r\n\rx",             // CR without LF at the end
            b"5\r\x00",              // CR without LF
            b";\r\n",                // an extension without a size
        ];
        for wire in cases {
            assert!(
                feed(Framing::Chunked, &[wire]).is_err(),
                "{:?}",
                String::from_utf8_lossy(wire)
            );
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // A fixed pseudo-random sequence (xorshift), biased towards framing characters.
        let alphabet = b"0123456789abcdefABCDEFxyz;= \t\r\n\r\n\r\n";
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        for _ in 0..20_000 {
            let mut wire = Vec::new();
            for _ in 0..(state % 40) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                wire.push(alphabet[(state % alphabet.len() as u64) as usize]);
            }
            let cut = if wire.is_empty() { 0 } else { (state as usize) % wire.len() };
            let _ = feed(Framing::Chunked, &[&wire[..cut], &wire[cut..]]);
            let _ = parse_head(&wire);
        }
    }

    fn head(wire: &[u8]) -> (Head, usize) {
        parse_head(wire).unwrap().unwrap()
    }

    #[test]
    fn a_head_is_parsed_only_once_complete() {
        let wire =
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\nok";
        for cut in 0..wire.len() - 2 {
            assert!(parse_head(&wire[..cut]).unwrap().is_none(), "cut at {cut}");
        }
        let (parsed, used) = head(wire);
        assert_eq!(used, wire.len() - 2);
        assert_eq!(parsed.status, StatusCode::OK);
        assert_eq!(parsed.framing, Framing::Length(2));
        assert!(parsed.keep_alive);
        assert_eq!(parsed.headers["content-type"], "application/json");
    }

    #[test]
    fn framing_follows_the_fields() {
        let chunked =
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: gzip, Chunked\r\n\r\n";
        assert_eq!(head(chunked).0.framing, Framing::Chunked);
        let not_last = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, gzip\r\n\r\n";
        let (parsed, _) = head(not_last);
        assert_eq!((parsed.framing, parsed.keep_alive), (Framing::Close, false));
        let none = b"HTTP/1.1 200 OK\r\n\r\n";
        assert_eq!((head(none).0.framing, head(none).0.keep_alive), (Framing::Close, false));
        let empty = b"HTTP/1.1 204 No Content\r\n\r\n";
        assert_eq!(head(empty).0.framing, Framing::Length(0));
        let same = b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 3\r\n\r\n";
        assert_eq!(head(same).0.framing, Framing::Length(3));
    }

    #[test]
    fn keep_alive_follows_version_and_connection() {
        let close =
            b"HTTP/1.1 200 OK\r\nconnection: keep-alive, Close\r\ncontent-length: 0\r\n\r\n";
        assert!(!head(close).0.keep_alive);
        let old = b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n";
        assert!(!head(old).0.keep_alive);
        let old_kept = b"HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\ncontent-length: 0\r\n\r\n";
        assert!(head(old_kept).0.keep_alive);
    }

    #[test]
    fn interim_answers_are_skipped() {
        let wire = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: x\r\n\r\nHTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n";
        let (parsed, used) = head(wire);
        assert_eq!((parsed.status, used), (StatusCode::SERVICE_UNAVAILABLE, wire.len()));
        assert!(!parsed.headers.contains_key("link"));
        assert!(parse_head(&wire[..30]).unwrap().is_none());
    }

    #[test]
    fn malformed_heads_are_errors() {
        let cases: &[&[u8]] = &[
            b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
            b"HTTP/2 200 OK\r\n\r\n",
            b"hello world\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: -3\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 3x\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nbad name: 1\r\n\r\n",
        ];
        for wire in cases {
            assert!(parse_head(wire).is_err(), "{:?}", String::from_utf8_lossy(wire));
        }
        let mut many = b"HTTP/1.1 200 OK\r\n".to_vec();
        for i in 0..=MAX_HEADERS {
            many.extend_from_slice(format!("x-{i}: 1\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert_eq!(parse_head(&many).unwrap_err(), Malformed("too many header fields"));
        let mut long = b"HTTP/1.1 200 OK\r\nx: ".to_vec();
        long.resize(MAX_HEAD + 1, b'a');
        assert_eq!(parse_head(&long).unwrap_err(), Malformed("the head is too large"));
    }
}
