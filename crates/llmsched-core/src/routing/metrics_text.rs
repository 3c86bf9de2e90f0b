//! Reading an engine's Prometheus `/metrics` text into a metrics update.
//!
//! vLLM: `vllm:num_requests_waiting`, `vllm:num_requests_running` (summed over engines),
//! `vllm:kv_cache_usage_perc` (older: `vllm:gpu_cache_usage_perc`; averaged over engines) and
//! `vllm:lora_requests_info` (labels `running_lora_adapters`, `waiting_lora_adapters`,
//! `max_lora`; the sample with the latest value wins). SGLang: `sglang:num_queue_reqs`,
//! `sglang:num_running_reqs`, `sglang:token_usage`. Other lines are ignored.
//!
//! [`parse_engine`] reads more (prefix-cache counters, preemptions, the cache config): all the
//! Python plane's scraper reads (`llmsched.integrations.metrics`), with its rules.
//!
//! Both run in one pass, linear in the text's length: an engine's `/metrics` is untrusted, and
//! a single line of a million labels must cost milliseconds. Label values are copied only for
//! the few labels read (of `vllm:lora_requests_info`, `vllm:cache_config_info`).

use super::endpoint::LoraState;
use super::pool::MetricsUpdate;
use super::RoutingError;

/// What a scrape says about an endpoint.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scrape {
    pub update: MetricsUpdate,
    pub loras: Option<LoraState>,
    /// The engine's KV block size: the `block_size` label of `vllm:cache_config_info` (a
    /// decimal count, the last sample's), if sent.
    pub block_size: Option<u32>,
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
    let mut block_size = None;
    for (n, line) in lines(text).enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        // The name is read once, for the labels to keep and for the sample.
        let name = name_of(line);
        let keep = match name {
            Some(LORA_INFO) => LORA_LABELS,
            Some(CACHE_INFO) => &CACHE_LABELS[..1],
            _ => &[],
        };
        let s = name.and_then(|name| named_sample(line, name, keep));
        let s = s.ok_or_else(|| unparsable(n, line))?;
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
            CACHE_INFO => {
                let size = s.labels.iter().find(|(k, _)| *k == "block_size");
                block_size = size.and_then(|(_, v)| label_count(v)).or(block_size);
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
        block_size,
    })
}

/// What the Python plane's scraper reads of an engine's `/metrics` text (its
/// `parse_engine_metrics`); `None`: not in the text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineMetrics {
    /// Summed over label sets, rounded (ties to even) and clamped to `0..=u32::MAX`, as are
    /// the other counts.
    pub waiting: Option<u32>,
    pub running: Option<u32>,
    /// The mean over label sets, clamped to `[0, 1]`: of `vllm:kv_cache_usage_perc`, else of
    /// `vllm:gpu_cache_usage_perc`, else of `sglang:token_usage`.
    pub kv_cache_usage: Option<f64>,
    /// `vllm:prefix_cache_queries_total` (older: `vllm:gpu_prefix_cache_queries_total`).
    pub prefix_cache_queries: Option<u32>,
    /// `vllm:prefix_cache_hits_total` (older: `vllm:gpu_prefix_cache_hits_total`).
    pub prefix_cache_hits: Option<u32>,
    /// `vllm:num_preemptions_total`.
    pub preemptions: Option<u32>,
    /// Labels of `vllm:cache_config_info` (a decimal count up to `u32::MAX`, else absent).
    pub block_size: Option<u32>,
    pub num_gpu_blocks: Option<u32>,
    /// Labels of `vllm:lora_requests_info`, of the sample with the latest value.
    pub loras: Option<LoraState>,
}

const LORA_INFO: &str = "vllm:lora_requests_info";
const LORA_LABELS: &[&str] = &["running_lora_adapters", "waiting_lora_adapters", "max_lora"];
const CACHE_INFO: &str = "vllm:cache_config_info";
const CACHE_LABELS: &[&str] = &["block_size", "num_gpu_blocks"];
/// KV-cache use, by preference: the current vLLM name, the older one, SGLang's.
const KV_NAMES: [&str; 3] =
    ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"];

/// Where a summed sample goes in [`parse_engine`]'s counts.
fn sum_index(name: &str) -> Option<usize> {
    Some(match name {
        "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => 0,
        "vllm:num_requests_running" | "sglang:num_running_reqs" => 1,
        "vllm:prefix_cache_queries_total" | "vllm:gpu_prefix_cache_queries_total" => 2,
        "vllm:prefix_cache_hits_total" | "vllm:gpu_prefix_cache_hits_total" => 3,
        "vllm:num_preemptions_total" => 4,
        _ => return None,
    })
}

/// Parses exposition text as the Python plane's scraper reads it (see [`EngineMetrics`]).
/// Only the lines of the metrics read are parsed (a broken one fails the text, naming it);
/// other lines are skipped unread. Fails when no load metric (waiting, running, KV use) is
/// present.
pub fn parse_engine(text: &str) -> Result<EngineMetrics, RoutingError> {
    let mut sums: [Option<f64>; 5] = [None; 5];
    let mut kv = [(0.0f64, 0u32); 3];
    let mut lora: Option<(f64, LoraState)> = None;
    let mut out = EngineMetrics::default();
    for (n, line) in lines(text).enumerate() {
        let line = line.trim();
        if line.starts_with('#') {
            continue;
        }
        let Some(name) = name_of(line) else { continue };
        let (sum, kv_at) = (sum_index(name), KV_NAMES.iter().position(|k| *k == name));
        let keep = match name {
            LORA_INFO => LORA_LABELS,
            CACHE_INFO => CACHE_LABELS,
            _ if sum.is_some() || kv_at.is_some() => &[],
            _ => continue,
        };
        let s = named_sample(line, name, keep).ok_or_else(|| unparsable(n, line))?;
        if !s.value.is_finite() {
            continue; // NaN or an infinity is no load reading
        }
        if let Some(i) = sum {
            sums[i] = Some(sums[i].unwrap_or(0.0) + s.value);
        } else if let Some(i) = kv_at {
            kv[i] = (kv[i].0 + s.value, kv[i].1 + 1);
        } else if name == CACHE_INFO {
            // A later sample's labels win, as the Python plane's dict update did.
            for (key, value) in &s.labels {
                let count = label_count(value);
                match *key {
                    "block_size" if count.is_some() => out.block_size = count,
                    "num_gpu_blocks" if count.is_some() => out.num_gpu_blocks = count,
                    _ => {}
                }
            }
        } else if lora.as_ref().is_none_or(|(v, _)| s.value >= *v) {
            lora = Some((s.value, lora_state(&s.labels)));
        }
    }
    // Sums of finite samples may reach an infinity (clamped) but never NaN.
    let count =
        |v: Option<f64>| v.map(|v| v.round_ties_even().clamp(0.0, f64::from(u32::MAX)) as u32);
    [out.waiting, out.running, out.prefix_cache_queries, out.prefix_cache_hits, out.preemptions] =
        sums.map(count);
    out.kv_cache_usage =
        kv.iter().find(|(_, n)| *n > 0).map(|(sum, n)| (sum / f64::from(*n)).clamp(0.0, 1.0));
    out.loras = lora.map(|(_, l)| l);
    if out.waiting.is_none() && out.running.is_none() && out.kv_cache_usage.is_none() {
        return Err(RoutingError::InvalidValue(
            "no vLLM or SGLang load metrics in the text".into(),
        ));
    }
    Ok(out)
}

/// A label's ASCII decimal count up to `u32::MAX` (the Python plane's rule: no sign, no
/// spaces, at most 10 digits).
fn label_count(raw: &str) -> Option<u32> {
    if raw.is_empty() || raw.len() > 10 || !raw.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    raw.parse().ok()
}

/// The error for line `n` (0-based), quoting at most its first 80 characters: a hostile line
/// may be megabytes long.
fn unparsable(n: usize, line: &str) -> RoutingError {
    let shown: String = line.chars().take(80).collect();
    let more = if shown.len() < line.len() { "..." } else { "" };
    RoutingError::InvalidValue(format!("metrics line {}: cannot parse {shown:?}{more}", n + 1))
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

/// The metric name a sample line starts with.
/// The lines of `text` as `str::lines` splits them (at `\n`, less a `\r` before it), each end
/// found by `memchr`, which searches a vector at a time (`str::lines` a word at a time).
fn lines(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let Some(end) = memchr::memchr(b'\n', rest.as_bytes()) else {
            return Some(std::mem::take(&mut rest));
        };
        let line = &rest[..end];
        rest = &rest[end + 1..];
        Some(line.strip_suffix('\r').unwrap_or(line))
    })
}

fn name_of(line: &str) -> Option<&str> {
    let ends = |c: char| c == '{' || c.is_whitespace();
    // A byte at a time while the line is ASCII (its whitespace is `char::is_whitespace`'s
    // below 0x80); past it, a character at a time.
    for (at, &byte) in line.as_bytes().iter().enumerate() {
        match byte {
            b'{' | b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r' => return Some(&line[..at]),
            0x80.. => return line[at..].find(ends).map(|end| &line[..at + end]),
            _ => {}
        }
    }
    None
}

/// One `name{labels} value [timestamp]` line, its name (`name_of(line)`) read already; of
/// its labels, those named in `keep`.
fn named_sample<'a>(line: &'a str, name: &'a str, keep: &[&str]) -> Option<Sample<'a>> {
    debug_assert_eq!(name_of(line), Some(name));
    let mut rest = &line[name.len()..];
    let mut labels = Vec::new();
    if rest.starts_with('{') {
        let (parsed, after) = label_set(&rest[1..], keep)?;
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

/// Labels up to the closing brace; returns those named in `keep` and the text after it.
fn label_set<'a>(mut s: &'a str, keep: &[&str]) -> Option<(Vec<(&'a str, String)>, &'a str)> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start_matches([' ', ',']);
        if let Some(after) = s.strip_prefix('}') {
            return Some((labels, after));
        }
        let eq = s.find('=')?;
        let key = s[..eq].trim();
        let body = s[eq + 1..].strip_prefix('"')?;
        if !keep.contains(&key) {
            s = &body[skip_value(body.as_bytes())? + 1..];
            continue;
        }
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

/// The index of the quote closing a label value (`body` starts after the opening one),
/// without copying it. An escape skips the byte after the backslash: a multi-byte character
/// there leaves continuation bytes, never a quote or a backslash.
fn skip_value(body: &[u8]) -> Option<usize> {
    let mut i = 0;
    loop {
        match *body.get(i)? {
            b'"' => return Some(i),
            b'\\' => i += 2,
            _ => i += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn lines_split_as_str_lines_splits_them() {
        for text in [
            "",
            "\n",
            "a",
            "a\n",
            "a\r\n",
            "a\r",
            "a\n\nb",
            "a\r\r\nb\r",
            "\r\n\r\n",
            "a\rb\n\u{e9}\n",
        ] {
            let ours: Vec<&str> = super::lines(text).collect();
            assert_eq!(ours, text.lines().collect::<Vec<_>>(), "{text:?}");
        }
    }

    #[test]
    fn a_name_ends_where_a_character_search_ends_it() {
        let slow = |line: &str| {
            line.find(|c: char| c == '{' || c.is_whitespace()).map(|end| line[..end].to_owned())
        };
        for line in [
            "",
            "a",
            "a b",
            "a{b=\"1\"} 2",
            "a\tb",
            "a\x0bb",
            "a\x0cb",
            "a\rb",
            "a\nb",
            "\u{e9}a b",
            "a\u{e9}\u{a0}b",
            "a\u{85}b",
            "a\u{2028}b",
            "a\u{3000}{",
            "\u{e9}",
            "a\u{1f600}",
            " a",
            "{",
        ] {
            assert_eq!(super::name_of(line).map(str::to_owned), slow(line), "{line:?}");
        }
    }

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
    fn the_scrape_reads_the_engine_block_size() {
        // What the gateway compares with its index's block size (absent: not compared).
        let load = "vllm:num_requests_running 1\n";
        let info = "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"9\"} 1\n";
        assert_eq!(parse(&format!("{load}{info}")).unwrap().block_size, Some(16));
        assert_eq!(parse(load).unwrap().block_size, None);
        let bad = "vllm:cache_config_info{block_size=\"+16\"} 1\n";
        assert_eq!(parse(&format!("{load}{info}{bad}")).unwrap().block_size, Some(16));
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

    #[test]
    fn the_engine_parse_reads_what_the_python_scraper_reads() {
        let text = "# TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\"} 2.0\nvllm:num_requests_running{engine=\"1\"} 4.5\n\
            vllm:num_requests_waiting 1e400\nvllm:num_requests_waiting -3\n\
            vllm:gpu_cache_usage_perc 0.25\nsglang:token_usage 0.9\nvllm:gpu_cache_usage_perc 0.75\n\
            vllm:gpu_prefix_cache_queries_total 100\nvllm:prefix_cache_queries_total 50\n\
            vllm:prefix_cache_hits_total 30\nvllm:num_preemptions_total 2.5\n\
            vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"+7\",x=\"\\\"\"} 1\n\
            vllm:cache_config_info{num_gpu_blocks=\"24\"} 1\n\
            vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"a, b\"} 2e9\n\
            vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"old\"} 1e9\n\
            some_histogram_bucket{le=\"broken 1\n";
        let m = parse_engine(text).unwrap();
        assert_eq!((m.waiting, m.running), (Some(0), Some(6)), "-3 -> 0; 6.5 rounds to even");
        assert_eq!(m.kv_cache_usage, Some(0.5), "the vLLM name before SGLang's");
        assert_eq!((m.prefix_cache_queries, m.prefix_cache_hits), (Some(150), Some(30)));
        assert_eq!(m.preemptions, Some(2));
        assert_eq!((m.block_size, m.num_gpu_blocks), (Some(16), Some(24)));
        let l = m.loras.unwrap();
        assert_eq!((l.active, l.max_loras), (vec!["a".to_string(), "b".to_string()], 4));
        let err = parse_engine("vllm:num_requests_waiting{a=\"1} 4\n").unwrap_err();
        assert!(err.to_string().contains("metrics line 1: cannot parse"), "{err}");
        assert!(parse_engine("up 1\nvllm:cache_config_info{block_size=\"16\"} 1\n").is_err());
    }

    #[test]
    fn a_line_of_a_million_labels_is_read_in_one_pass() {
        // Probe 49 F15: the text an engine serves is untrusted and may be one line of 8 MiB.
        let labels: Vec<String> = (0..700_000).map(|i| format!("a{i}=\"b\\\"\"")).collect();
        let line = format!("vllm:num_requests_waiting{{{}}} 3\n", labels.join(","));
        assert!(line.len() > 8 << 20);
        assert_eq!(parse_engine(&line).unwrap().waiting, Some(3));
        assert_eq!(parse(&line).unwrap().update.waiting, Some(3));
        let cut = &line[..line.len() - 4];
        let err = parse_engine(cut).unwrap_err().to_string();
        assert!(err.len() < 200 && err.ends_with("..."), "the line is quoted in part: {err}");
    }
}
