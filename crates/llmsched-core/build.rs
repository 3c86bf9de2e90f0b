//! Sets `llmsched_avx512` when the compiler's AVX-512 intrinsics are stable (Rust 1.89 and
//! newer), so the AVX-512 VBMI token-id decoder is built there and the crate still builds with
//! its declared minimum, 1.85, without it.

use std::process::Command;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(llmsched_avx512)");
    println!("cargo::rerun-if-env-changed=RUSTC");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let Ok(out) = Command::new(rustc).arg("--version").output() else { return };
    let version = String::from_utf8_lossy(&out.stdout);
    // "rustc 1.95.0 (59807616e 2026-04-14)"
    let minor = version
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.split('.').nth(1))
        .and_then(|m| m.parse::<u32>().ok());
    if minor.is_some_and(|m| m >= 89) {
        println!("cargo::rustc-cfg=llmsched_avx512");
    }
}
