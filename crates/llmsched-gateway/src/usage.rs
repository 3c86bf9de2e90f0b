//! Usage shared between gateway replicas (replica sync, `llmsched.cluster`): what this gateway
//! took from each rate-limited key and served each tenant since the last flush, and the
//! charging of other replicas' usage, so that a key's rate and tenants' fairness hold across
//! replicas. The embedder's sync transport calls these once per flush (`cluster.flush_s`),
//! never per request; the request path only counts (in the key limiters and flow control).

use crate::{monotonic, Gateway};

/// Usage since the last flush (the shape of `llmsched.cluster.Usage`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Usage {
    /// Per rate-limited key, by the hex of its SHA-256: requests and tokens taken.
    pub keys: Vec<(String, f64, f64)>,
    /// Per flow: tenant, priority, prompt tokens and output tokens served.
    pub tenants: Vec<(String, i32, u64, u64)>,
}

fn hex(digest: &[u8; 32]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<[u8; 32]> {
    let bytes = text.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in bytes.chunks(2).enumerate() {
        let pair = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(out)
}

impl Gateway {
    /// This gateway's usage since the last call (keys with rates, tenants' service).
    pub(crate) fn drain_usage(&self) -> Usage {
        let keys = self
            .keys
            .limiters()
            .filter(|(_, limiter)| limiter.limits_rates())
            .filter_map(|(digest, limiter)| {
                let (requests, tokens) = limiter.drain_usage();
                (requests, tokens).ne(&(0.0, 0.0)).then(|| (hex(digest), requests, tokens))
            })
            .collect();
        let tenants = match &self.flow {
            None => Vec::new(),
            Some(flow) => flow
                .drain_service()
                .into_iter()
                .map(|(tenant, priority, prompt, output)| {
                    (tenant.to_string(), priority, prompt, output)
                })
                .collect(),
        };
        Usage { keys, tenants }
    }

    /// Other replicas' usage, charged to the same keys' buckets and tenants' flows here
    /// (unknown keys and tenants are skipped).
    pub(crate) fn apply_usage(&self, usage: &Usage) {
        let now = monotonic();
        for (digest, requests, tokens) in &usage.keys {
            let limiter = unhex(digest).and_then(|d| self.keys.limiter_of(&d).cloned());
            if let Some(limiter) = limiter {
                limiter.charge_remote(*requests, *tokens, now);
            }
        }
        if let Some(flow) = &self.flow {
            for (tenant, priority, prompt, output) in &usage.tenants {
                flow.charge_remote(tenant, *priority, *prompt, *output, now);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_go_to_hex_and_back() {
        let digest = [0xab; 32];
        assert_eq!(unhex(&hex(&digest)), Some(digest));
        assert_eq!(unhex("ab"), None);
        assert_eq!(unhex(&"zz".repeat(32)), None);
    }
}
