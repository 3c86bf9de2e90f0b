//! A grammar check of a JSON object that finds its members without decoding anything.
//!
//! [`object_members`] walks a JSON text as serde_json's reader walks the values it skips
//! (`IgnoredAny`, `&RawValue`: the grammar only, numbers of any size) and hands over each
//! top-level member's key and where its value lies. A long string value (a prompt, a message's
//! content) is crossed by a vectorised search for its closing quote or an escape
//! (`memchr2`) and one pass over the bytes between, for control characters and bytes past
//! ASCII, where serde_json looks at every eight bytes in turn.
//!
//! It answers only what it can answer without a doubt: a text it does not take whole (not
//! JSON, not an object, not UTF-8, nested past a depth, an escaped key, any `\uD800`-`\uDFFF`
//! escape, or an escaped backslash followed by such text) gives `None`, and the caller reads the
//! text the slow way, which says why.

/// The top-level members of the JSON object `raw`: `member(key, start, end, escaped)` for
/// each, in order (`raw[start..end]` is its value's text, without the whitespace around it;
/// the key is the text between its quotes, which has no escape; `escaped`: the value is a
/// string with an escape). None, with members perhaps already
/// handed over, when the text is not one JSON object nested at most `max_depth` deep (the
/// object itself is 1), or is not UTF-8, or has an escaped key or a surrogate escape (or
/// text that looks like one after an escaped backslash).
pub(crate) fn object_members<'a>(
    raw: &'a [u8],
    max_depth: usize,
    mut member: impl FnMut(&'a [u8], usize, usize, bool),
) -> Option<()> {
    let mut scan = Scan { raw, at: 0, high: 0 };
    scan.space();
    if scan.peek()? != b'{' {
        return None;
    }
    scan.at += 1;
    scan.space();
    if scan.peek()? == b'}' {
        scan.at += 1;
    } else {
        loop {
            let key = scan.key()?;
            scan.space();
            let start = scan.at;
            let escaped = scan.value(2, max_depth)?;
            member(key, start, scan.at, escaped);
            scan.space();
            match scan.peek()? {
                b',' => scan.at += 1,
                b'}' => {
                    scan.at += 1;
                    break;
                }
                _ => return None,
            }
        }
    }
    scan.space();
    if scan.at != raw.len() {
        return None;
    }
    // Bytes past ASCII are only valid in strings, where the scan noted them: the text is
    // checked whole once when there were any.
    if scan.high >= 0x80 && std::str::from_utf8(raw).is_err() {
        return None;
    }
    Some(())
}

/// The cursor of [`object_members`]; `high` is the bitwise or of the bytes of the strings
/// crossed (at least 0x80 when any was past ASCII).
struct Scan<'a> {
    raw: &'a [u8],
    at: usize,
    high: u8,
}

impl<'a> Scan<'a> {
    fn peek(&self) -> Option<u8> {
        self.raw.get(self.at).copied()
    }

    /// Past JSON's whitespace (as serde_json: space, tab, line feed, carriage return).
    fn space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    /// A member's key and its colon: the key's text (None when escaped).
    fn key(&mut self) -> Option<&'a [u8]> {
        self.space();
        if self.peek()? != b'"' {
            return None;
        }
        let start = self.at + 1;
        if self.string()? {
            return None;
        }
        let key = &self.raw[start..self.at - 1];
        self.space();
        if self.peek()? != b':' {
            return None;
        }
        self.at += 1;
        Some(key)
    }

    /// A value at `depth` (its arrays and objects one deeper); the cursor on its first byte.
    /// Whether it is a string with an escape.
    fn value(&mut self, depth: usize, max_depth: usize) -> Option<bool> {
        match self.peek()? {
            b'"' => self.string(),
            b'{' => {
                if depth > max_depth {
                    return None;
                }
                self.at += 1;
                self.space();
                if self.peek()? == b'}' {
                    self.at += 1;
                    return Some(false);
                }
                loop {
                    self.key_any()?;
                    self.space();
                    self.value(depth + 1, max_depth)?;
                    self.space();
                    match self.peek()? {
                        b',' => self.at += 1,
                        b'}' => {
                            self.at += 1;
                            return Some(false);
                        }
                        _ => return None,
                    }
                }
            }
            b'[' => {
                if depth > max_depth {
                    return None;
                }
                self.at += 1;
                self.space();
                if self.peek()? == b']' {
                    self.at += 1;
                    return Some(false);
                }
                loop {
                    self.space();
                    self.value(depth + 1, max_depth)?;
                    self.space();
                    match self.peek()? {
                        b',' => self.at += 1,
                        b']' => {
                            self.at += 1;
                            return Some(false);
                        }
                        _ => return None,
                    }
                }
            }
            b't' => self.word(b"true").map(|()| false),
            b'f' => self.word(b"false").map(|()| false),
            b'n' => self.word(b"null").map(|()| false),
            _ => self.number().map(|()| false),
        }
    }

    /// A nested object's key (escapes allowed) and its colon.
    fn key_any(&mut self) -> Option<()> {
        self.space();
        if self.peek()? != b'"' {
            return None;
        }
        self.string()?;
        self.space();
        if self.peek()? != b':' {
            return None;
        }
        self.at += 1;
        Some(())
    }

    fn word(&mut self, word: &[u8]) -> Option<()> {
        if !self.raw[self.at..].starts_with(word) {
            return None;
        }
        self.at += word.len();
        Some(())
    }

    fn digits(&mut self) -> usize {
        let start = self.at;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.at += 1;
        }
        self.at - start
    }

    /// A number as JSON spells it (serde_json's `ignore_integer`: one leading zero at most;
    /// a fraction and an exponent of one digit or more); its size does not matter.
    fn number(&mut self) -> Option<()> {
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        match self.peek()? {
            b'0' => {
                self.at += 1;
                if matches!(self.peek(), Some(b'0'..=b'9')) {
                    return None;
                }
            }
            b'1'..=b'9' => {
                self.digits();
            }
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.at += 1;
            if self.digits() == 0 {
                return None;
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            if self.digits() == 0 {
                return None;
            }
        }
        Some(())
    }

    /// The string at the cursor (its opening quote), the cursor left past its closing one:
    /// whether it had an escape. None for a raw control character, a malformed escape, a
    /// surrogate escape, or no closing quote.
    fn string(&mut self) -> Option<bool> {
        self.at += 1;
        let mut escaped = false;
        loop {
            let rest = &self.raw[self.at..];
            let next = memchr::memchr2(b'"', b'\\', rest)?;
            // A control character is below 0x20 (JSON refuses it raw in a string); a byte past
            // ASCII has 0x80 set.
            let (low, high) = low_and_bits(&rest[..next]);
            if low < 0x20 {
                return None;
            }
            self.high |= high;
            self.at += next + 1;
            if rest[next] == b'"' {
                return Some(escaped);
            }
            escaped = true;
            match self.peek()? {
                b'"' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => self.at += 1,
                b'\\' => {
                    // The slow reading looks for surrogate escapes as any backslash followed
                    // by `uD800`-`uDFFF`, this escaped one too (and a body with one is parsed
                    // whole there, which refuses numbers past f64's range): left to it.
                    if let Some([b'u', d, hex]) = self.raw.get(self.at + 1..self.at + 4) {
                        if d.eq_ignore_ascii_case(&b'd')
                            && matches!(hex.to_ascii_lowercase(), b'8'..=b'9' | b'a'..=b'f')
                        {
                            return None;
                        }
                    }
                    self.at += 1;
                }
                b'u' => {
                    let digits = self.raw.get(self.at + 1..self.at + 5)?;
                    let mut unit = 0u32;
                    for &digit in digits {
                        unit = unit << 4 | char::from(digit).to_digit(16)?;
                    }
                    // Whether a surrogate is paired is settled the slow way.
                    if (0xD800..0xE000).contains(&unit) {
                        return None;
                    }
                    self.at += 5;
                }
                _ => return None,
            }
        }
    }
}

/// The smallest byte of `bytes` and the bitwise or of them all, in one pass that vectorises
/// (lanes of 32 bytes: a minimum and an or each, no branch; the tail byte by byte).
fn low_and_bits(bytes: &[u8]) -> (u8, u8) {
    const LANES: usize = 32;
    let mut chunks = bytes.chunks_exact(LANES);
    let (mut low, mut bits) = (u8::MAX, 0u8);
    if bytes.len() >= LANES {
        let (mut lows, mut ors) = ([u8::MAX; LANES], [0u8; LANES]);
        for chunk in &mut chunks {
            for ((low, or), &byte) in lows.iter_mut().zip(&mut ors).zip(chunk) {
                *low = (*low).min(byte);
                *or |= byte;
            }
        }
        low = lows.into_iter().fold(low, u8::min);
        bits = ors.into_iter().fold(bits, |a, b| a | b);
    }
    for &byte in chunks.remainder() {
        low = low.min(byte);
        bits |= byte;
    }
    (low, bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(text: &str) -> Option<Vec<(String, String)>> {
        let mut found = Vec::new();
        object_members(text.as_bytes(), 4, |key, start, end, _| {
            found.push((String::from_utf8(key.to_vec()).unwrap(), text[start..end].to_owned()));
        })?;
        Some(found)
    }

    #[test]
    fn members_are_found_with_their_values_text() {
        let text = " {\"a\" : [1, {\"b\\u00e9\": -0.5e+3}] ,\"s\":\"x\\\"y\\\\\\/\\n\u{e9}\",\"n\":null}\n";
        let expected = [
            ("a", "[1, {\"b\\u00e9\": -0.5e+3}]"),
            ("s", "\"x\\\"y\\\\\\/\\n\u{e9}\""),
            ("n", "null"),
        ];
        let expected: Vec<(String, String)> =
            expected.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        assert_eq!(members(text), Some(expected));
        assert_eq!(members("{}"), Some(Vec::new()));
    }

    #[test]
    fn the_smallest_byte_and_the_bits_of_all() {
        for len in [0, 1, 31, 32, 33, 64, 100] {
            for at in 0..len {
                // Beside `a`s, when there are others.
                let others = if len > 1 { b'a' } else { 0 };
                let mut bytes = vec![b'a'; len];
                bytes[at] = 0x1f;
                assert_eq!(low_and_bits(&bytes), (0x1f, others | 0x1f), "{len} {at}");
                bytes[at] = 0xe9;
                let low = if len > 1 { b'a' } else { 0xe9 };
                assert_eq!(low_and_bits(&bytes), (low, others | 0xe9), "{len} {at}");
            }
        }
        assert_eq!(low_and_bits(b""), (u8::MAX, 0));
    }

    #[test]
    fn a_string_value_with_an_escape_is_told() {
        let text = r#"{"a": "x", "b": "x\ny", "c": ["\n"], "d": {"\n": 1}, "e": 1}"#;
        let mut escaped = Vec::new();
        object_members(text.as_bytes(), 4, |_, _, _, e| escaped.push(e)).unwrap();
        assert_eq!(escaped, [false, true, false, false, false]);
    }

    #[test]
    fn anything_doubtful_is_left_to_the_slow_reading() {
        for text in [
            "",
            "[]",
            "{\"a\": 1,}",
            "{\"a\": 01}",
            "{\"a\": 1.}",
            "{\"a\": 1e}",
            "{\"a\": -}",
            "{\"a\": tru}",
            "{\"a\": \"\u{1}\"}",
            "{\"a\": \"\\x\"}",
            "{\"a\": \"\\u12g4\"}",
            "{\"a\": \"\\ud83d\\ude00\"}",
            "{\"a\": \"\\uDFFF\"}",
            "{\"a\": \"\\\\uDb00\"}",
            "{\"\\u0061\": 1}",
            "{\"a\": 1} x",
            "{\"a\": [[[[1]]]]}",
            "{\"a\": \"unterminated}",
            "{\"a\" 1}",
            "{1: 1}",
        ] {
            assert_eq!(members(text), None, "{text:?}");
        }
        // Four deep is the limit given here.
        assert!(members("{\"a\": [[[1]]]}").is_some());
        // Not UTF-8 inside a string.
        assert!(object_members(b"{\"a\": \"\xff\"}", 4, |_, _, _, _| {}).is_none());
        assert!(object_members(b"{\"a\": \"\xc3\xa9\"}", 4, |_, _, _, _| {}).is_some());
    }
}
