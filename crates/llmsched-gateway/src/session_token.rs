//! llm-d's session token (`x-session-token`): the base64 (standard alphabet) of the identity of
//! the endpoint a session is on, read on requests and set on answers, as the Python plane's
//! `llmsched.gateway.session_token` does (its module doc states the model).
//!
//! An endpoint's identity is `<namespace>/<worker id>` when the engines come from Kubernetes
//! discovery (the pod's namespaced name, as llm-d names it), else the worker id. Reading takes
//! the standard alphabet with or without its `=` padding and UTF-8 text; anything else is no
//! token (ignored, never an error).

/// The header llm-d's session-affinity scorer reads on requests and sets on answers.
pub const SESSION_TOKEN_HEADER: &str = "x-session-token";

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Mints and reads the tokens of one gateway.
#[derive(Debug, Clone, Default)]
pub struct SessionTokens {
    /// `<namespace>/` with Kubernetes discovery, else empty.
    prefix: String,
}

impl SessionTokens {
    /// Tokens for engines discovered in Kubernetes `namespace` (None: not from Kubernetes).
    pub fn new(namespace: Option<&str>) -> SessionTokens {
        SessionTokens { prefix: namespace.map_or_else(String::new, |ns| format!("{ns}/")) }
    }

    /// The token of the engine `worker_id`.
    pub fn token(&self, worker_id: &str) -> String {
        let mut identity = Vec::with_capacity(self.prefix.len() + worker_id.len());
        identity.extend_from_slice(self.prefix.as_bytes());
        identity.extend_from_slice(worker_id.as_bytes());
        encode(&identity)
    }

    /// The worker id `token` names, or None when it is no token of this gateway's (not
    /// base64, not UTF-8, another namespace). Whether that engine exists is the caller's to
    /// check.
    pub fn endpoint(&self, token: &[u8]) -> Option<String> {
        let name = String::from_utf8(decode(token.trim_ascii())?).ok()?;
        let id = name.strip_prefix(self.prefix.as_str())?;
        (!id.is_empty()).then(|| id.to_owned())
    }
}

/// Standard base64 with padding.
fn encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Standard base64, the `=` padding optional (at most two); None for anything else.
fn decode(text: &[u8]) -> Option<Vec<u8>> {
    let body = text.strip_suffix(b"==").or_else(|| text.strip_suffix(b"=")).unwrap_or(text);
    if body.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() / 4 * 3 + 2);
    for chunk in body.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            let v = match c {
                b'A'..=b'Z' => c - b'A',
                b'a'..=b'z' => c - b'a' + 26,
                b'0'..=b'9' => c - b'0' + 52,
                b'+' => 62,
                b'/' => 63,
                _ => return None,
            };
            n |= u32::from(v) << (18 - 6 * i);
        }
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_reads_llm_d_s_tokens() {
        let k8s = SessionTokens::new(Some("llm"));
        // What llm-d mints for pod llm/vllm-0 (Go's base64.StdEncoding).
        assert_eq!(k8s.token("vllm-0"), "bGxtL3ZsbG0tMA==");
        assert_eq!(k8s.endpoint(b"bGxtL3ZsbG0tMA==").as_deref(), Some("vllm-0"));
        assert_eq!(k8s.endpoint(b"bGxtL3ZsbG0tMA").as_deref(), Some("vllm-0"));
        // Another namespace, or none, is no token of this gateway's.
        assert_eq!(k8s.endpoint(SessionTokens::new(Some("x")).token("vllm-0").as_bytes()), None);
        assert_eq!(k8s.endpoint(SessionTokens::new(None).token("vllm-0").as_bytes()), None);
        assert_eq!(k8s.endpoint(k8s.token("").as_bytes()), None);
        let plain = SessionTokens::default();
        for id in ["a", "ab", "abc", "10.0.0.7:8000", "[::1]:8000/dp2", "é-ü"] {
            assert_eq!(plain.endpoint(plain.token(id).as_bytes()).as_deref(), Some(id), "{id}");
        }
    }

    #[test]
    fn anything_else_is_no_token() {
        let plain = SessionTokens::default();
        for bad in [&b"%%%"[..], b"YQ===", b"Y", b"YWJj-", b"YW Jj", b"/w==", b"", b"="] {
            assert_eq!(plain.endpoint(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
        assert_eq!(encode(b"\xff"), "/w==");
    }
}
