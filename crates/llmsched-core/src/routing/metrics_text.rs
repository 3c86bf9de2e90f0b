//! Reading an engine's Prometheus `/metrics` text into a metrics update.
//!
//! vLLM: `vllm:num_requests_waiting`, `vllm:num_requests_running` (summed over engines),
//! `vllm:kv_cache_usage_perc` (older: `vllm:gpu_cache_usage_perc`; averaged over engines) and
//! `vllm:lora_requests_info` (labels `running_lora_adapters`, `waiting_lora_adapters`,
//! `max_lora`; the sample with the latest value wins). SGLang: `sglang:num_queue_reqs`,
//! `sglang:num_running_reqs`, `sglang:token_usage`. Other lines are ignored.

use super::endpoint::LoraState;
use super::pool::MetricsUpdate;
use super::RoutingError;

/// What a scrape says about an endpoint.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scrape {
    pub update: MetricsUpdate,
    pub loras: Option<LoraState>,
}

struct Sample<'a> {
    name: &'a str,
    labels: Vec<(&'a str, String)>,
    value: f64,
}

/// Parses exposition text. Fails when no known load metric is present.
pub fn parse(text: &str) -> Result<Scrape, RoutingError> {
    let mut waiting: Option<f64> = None;
    let mut running: Option<f64> = None;
    let mut kv: (f64, u32) = (0.0, 0);
    let mut old_kv: (f64, u32) = (0.0, 0);
    let mut lora: Option<(f64, LoraState)> = None;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let s = sample(line).ok_or_else(|| {
            RoutingError::InvalidValue(format!("metrics line {}: cannot parse {line:?}", n + 1))
        })?;
        if !s.value.is_finite() {
            continue; // NaN or an infinity is no load reading (the Python plane skips them too)
        }
        let add = |acc: &mut Option<f64>| *acc = Some(acc.unwrap_or(0.0) + s.value);
        match s.name {
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => add(&mut waiting),
            "vllm:num_requests_running" | "sglang:num_running_reqs" => add(&mut running),
            "vllm:kv_cache_usage_perc" | "sglang:token_usage" => kv = (kv.0 + s.value, kv.1 + 1),
            "vllm:gpu_cache_usage_perc" => old_kv = (old_kv.0 + s.value, old_kv.1 + 1),
            "vllm:lora_requests_info" if lora.as_ref().is_none_or(|(v, _)| s.value >= *v) => {
                lora = Some((s.value, lora_state(&s.labels)));
            }
            _ => {}
        }
    }
    let kv = if kv.1 > 0 {
        Some(kv.0 / f64::from(kv.1))
    } else if old_kv.1 > 0 {
        Some(old_kv.0 / f64::from(old_kv.1))
    } else {
        None
    };
    if waiting.is_none() && running.is_none() && kv.is_none() {
        return Err(RoutingError::InvalidValue(
            "no vLLM or SGLang load metrics found in the text".into(),
        ));
    }
    let count = |v: Option<f64>| v.map(|v| v.max(0.0).round().min(f64::from(u32::MAX)) as u32);
    Ok(Scrape {
        update: MetricsUpdate {
            waiting: count(waiting),
            running: count(running),
            kv_cache_usage: kv.map(|v| v.clamp(0.0, 1.0)),
            max_concurrency: None,
        },
        loras: lora.map(|(_, l)| l),
    })
}

fn lora_state(labels: &[(&str, String)]) -> LoraState {
    let list = |key: &str| -> Vec<String> {
        labels
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| {
                v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect()
            })
            .unwrap_or_default()
    };
    let max_loras = labels
        .iter()
        .find(|(k, _)| *k == "max_lora")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    LoraState {
        active: list("running_lora_adapters"),
        waiting: list("waiting_lora_adapters"),
        max_loras,
    }
}

/// One `name{labels} value [timestamp]` line.
fn sample(line: &str) -> Option<Sample<'_>> {
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if rest.starts_with('{') {
        let (parsed, after) = label_set(&rest[1..])?;
        labels = parsed;
        rest = after;
    }
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "NaN" => f64::NAN,
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample { name, labels, value })
}

/// Labels up to the closing brace; returns them and the text after it.
fn label_set(mut s: &str) -> Option<(Vec<(&str, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start_matches([' ', ',']);
        if let Some(after) = s.strip_prefix('}') {
            return Some((labels, after));
        }
        let eq = s.find('=')?;
        let key = s[..eq].trim();
        let body = s[eq + 1..].strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = body.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '"' => break i,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                c => value.push(c),
            }
        };
        labels.push((key, value));
        s = &body[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_captured_vllm_metrics() {
        // The repository's tests/data, found from this crate's folder upwards.
        let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let path = manifest
            .ancestors()
            .map(|dir| dir.join("tests/data/vllm_metrics_under_load.txt"))
            .find(|path| path.is_file())
            .expect("tests/data/vllm_metrics_under_load.txt is in the repository");
        let text = std::fs::read_to_string(path).unwrap();
        let s = parse(&text).unwrap();
        assert_eq!(s.update.waiting, Some(7));
        assert_eq!(s.update.running, Some(3));
        assert!((s.update.kv_cache_usage.unwrap() - 0.782608695652174).abs() < 1e-12);
    }

    #[test]
    fn values_that_are_no_load_reading_are_skipped() {
        let s = parse(
            "vllm:num_requests_waiting +Inf\nvllm:num_requests_running 1e400\n\
             vllm:num_requests_running 3\nvllm:kv_cache_usage_perc NaN\n",
        )
        .unwrap();
        assert_eq!(
            (s.update.waiting, s.update.running, s.update.kv_cache_usage),
            (None, Some(3), None)
        );
    }

    #[test]
    fn sglang_lora_and_errors() {
        let text = "# HELP x\nsglang:num_queue_reqs{a=\"1\"} 4\nsglang:num_running_reqs 2\nsglang:token_usage 0.5\n\
            vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a,b\",waiting_lora_adapters=\"\"} 10.0\n\
            vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a\",waiting_lora_adapters=\"c\"} 5.0\n";
        let s = parse(text).unwrap();
        assert_eq!(
            (s.update.waiting, s.update.running, s.update.kv_cache_usage),
            (Some(4), Some(2), Some(0.5))
        );
        let l = s.loras.unwrap();
        assert_eq!(
            (l.active, l.waiting, l.max_loras),
            (vec!["a".to_string(), "b".to_string()], vec![], 2)
        );
        assert!(parse("up 1\n").is_err());
        assert!(parse("vllm:num_requests_waiting{a=\"1} 4\n").is_err());
        let escaped = parse("vllm:num_requests_running{x=\"a\\\"}b\"} 3\n").unwrap();
        assert_eq!(escaped.update.running, Some(3));
    }
}
