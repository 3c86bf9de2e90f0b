//! A small `--flag value` parser for the harness's binaries (no dependency for a dozen flags).

use std::collections::HashMap;
use std::str::FromStr;

/// Command-line flags: `--name value` pairs (a flag may repeat) and bare `--switch`es.
pub struct Args {
    values: HashMap<String, Vec<String>>,
    switches: Vec<String>,
}

impl Args {
    /// Parses `argv` (without the program name); `switches` names the flags that take no value.
    pub fn parse(
        argv: impl IntoIterator<Item = String>,
        switches: &[&str],
    ) -> Result<Self, String> {
        let mut values: HashMap<String, Vec<String>> = HashMap::new();
        let mut found = Vec::new();
        let mut argv = argv.into_iter();
        while let Some(arg) = argv.next() {
            let Some(name) = arg.strip_prefix("--") else {
                return Err(format!("unexpected argument {arg:?}"));
            };
            let (name, inline) = match name.split_once('=') {
                Some((name, value)) => (name.to_string(), Some(value.to_string())),
                None => (name.to_string(), None),
            };
            if switches.contains(&name.as_str()) && inline.is_none() {
                found.push(name);
                continue;
            }
            let value = match inline {
                Some(value) => value,
                None => argv.next().ok_or_else(|| format!("--{name} needs a value"))?,
            };
            values.entry(name).or_default().push(value);
        }
        Ok(Args { values, switches: found })
    }

    /// Whether the switch `--name` was given.
    pub fn switch(&self, name: &str) -> bool {
        self.switches.iter().any(|s| s == name)
    }

    /// The last value of `--name` parsed as `T`, or `default`.
    pub fn get<T: FromStr>(&self, name: &str, default: T) -> Result<T, String>
    where
        T::Err: std::fmt::Display,
    {
        match self.values.get(name).and_then(|v| v.last()) {
            None => Ok(default),
            Some(text) => text.parse().map_err(|e| format!("--{name} {text:?}: {e}")),
        }
    }

    /// Every value of `--name` parsed as `T`, in order.
    pub fn all<T: FromStr>(&self, name: &str) -> Result<Vec<T>, String>
    where
        T::Err: std::fmt::Display,
    {
        self.values
            .get(name)
            .map(|v| {
                v.iter().map(|t| t.parse().map_err(|e| format!("--{name} {t:?}: {e}"))).collect()
            })
            .unwrap_or(Ok(Vec::new()))
    }

    /// Fails naming the first flag not in `known`.
    pub fn only(&self, known: &[&str]) -> Result<(), String> {
        match self.values.keys().chain(self.switches.iter()).find(|k| !known.contains(&k.as_str()))
        {
            Some(name) => Err(format!("unknown flag --{name}")),
            None => Ok(()),
        }
    }
}
