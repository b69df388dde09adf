//! CUBINs of our fixed kernel files built ahead of time, shipped inside the binary.
//!
//! # Why
//!
//! A fresh machine otherwise waits for NVRTC on the first use of every fixed kernel group
//! (`reduce.cu`'s f32 group alone takes ~2 s, its f16 group ~7 s on a small VM). `build.rs`
//! compiles every group of every fixed file ([`Module::ALL`] × [`Module::groups`]) for the
//! architectures in `KILN_PREBUILT_ARCHS` (default `90`) when it can load NVRTC at build time,
//! from the same text and options as the run time (`kernel_files.rs`, shared by `#[path]`),
//! and writes the table this module includes. Where it cannot (no NVRTC, `KILN_PREBUILT=0` at
//! build time) the table is empty and everything compiles at run time as before.
//!
//! At run time [`find`] hands out an entry only when its architecture can run on the device
//! (same major, minor not above the device's: an `sm_80` CUBIN runs on `sm_86`/`sm_89`, never
//! on `sm_90`) and its source hash matches the text the run time would compile. A driver that
//! refuses the image (older than the NVRTC that built it) costs a compile, never an error
//! (`device/kernels.rs`). `KILN_PREBUILT=0` at run time ignores the table.
//!
//! Runtime layer, beside `nvrtc.rs`: it knows the fixed files' texts only.

use crate::kernel_files::{Group, Module, source_hash};

/// One prebuilt CUBIN: of group `group` ([`Group::label`]) of `file`, for `sm_{arch}`.
pub(crate) struct Prebuilt {
    pub file: &'static str,
    pub group: &'static str,
    pub arch: u32,
    /// [`source_hash`] of the text and options it was built from.
    pub source_hash: u64,
    pub cubin: &'static Image<[u8]>,
}

/// A CUBIN image aligned to 16 bytes (`include_bytes!` alone guarantees 1; an ELF image is
/// read as 8-byte words by the driver).
pub(crate) struct Image<B: ?Sized> {
    pub _align: [u128; 0],
    pub bytes: B,
}

// `TABLE: &[Prebuilt]`, `NVRTC: (i32, i32)` (the version that built it, `(0, 0)` if none) and
// `NOTE: &str` (why the table is empty, or what it holds), written by build.rs.
include!(concat!(env!("OUT_DIR"), "/prebuilt_table.rs"));

/// Whether prebuilt CUBINs may be used: not when `KILN_PREBUILT=0` (read once).
pub(crate) fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_PREBUILT").map_or(true, |v| v.trim() != "0"))
}

/// The prebuilt CUBIN for `group` of `module` on a device of compute capability `arch`, if the
/// binary has one that runs there and was built from the current text; `None` when disabled.
pub(crate) fn find(module: Module, group: Group, arch: u32) -> Option<&'static Prebuilt> {
    if !enabled() {
        return None;
    }
    pick(TABLE, module.file_name(), group.label(), arch).filter(|p| {
        p.source_hash == source_hash(module, &module.group_source(group), p.arch, NVRTC)
    })
}

/// What the binary holds, for the compile log: `(entries, NVRTC version, note)`.
pub(crate) fn summary() -> (usize, (i32, i32), &'static str) {
    (TABLE.len(), NVRTC, NOTE)
}

/// Whether a CUBIN for `sm_{built}` runs on a device of compute capability `device`: same
/// major version, minor not above the device's (CUDA's binary compatibility rule).
pub(crate) fn runs_on(built: u32, device: u32) -> bool {
    built / 10 == device / 10 && built <= device
}

/// The entry of `table` for (`file`, `group`) that runs on `arch`: the exact architecture if
/// present, else the newest compatible one.
fn pick<'a>(table: &'a [Prebuilt], file: &str, group: &str, arch: u32) -> Option<&'a Prebuilt> {
    table
        .iter()
        .filter(|p| p.file == file && p.group == group && runs_on(p.arch, arch))
        .max_by_key(|p| p.arch)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(file: &'static str, group: &'static str, arch: u32) -> Prebuilt {
        Prebuilt {
            file,
            group,
            arch,
            source_hash: 0,
            cubin: &Image {
                _align: [],
                bytes: [],
            },
        }
    }

    #[test]
    fn pick_takes_the_exact_arch_else_the_newest_compatible_one() {
        let t = [
            entry("reduce.cu", "float", 80),
            entry("reduce.cu", "float", 86),
            entry("reduce.cu", "float", 90),
            entry("reduce.cu", "f16", 90),
            entry("util.cu", "*", 90),
        ];
        assert_eq!(pick(&t, "reduce.cu", "float", 90).unwrap().arch, 90);
        assert_eq!(pick(&t, "reduce.cu", "float", 89).unwrap().arch, 86);
        assert_eq!(pick(&t, "reduce.cu", "float", 86).unwrap().arch, 86);
        assert_eq!(pick(&t, "reduce.cu", "float", 80).unwrap().arch, 80);
        // sm_90 code never runs on sm_8x, nor sm_8x code on sm_90/sm_100.
        assert!(pick(&t, "reduce.cu", "f16", 89).is_none());
        assert!(pick(&t, "reduce.cu", "float", 75).is_none());
        assert!(pick(&t, "reduce.cu", "float", 100).is_none());
        assert!(pick(&t, "reduce.cu", "double", 90).is_none());
        assert_eq!(pick(&t, "util.cu", "*", 90).unwrap().file, "util.cu");
        assert!(pick(&t, "util.cu", "float", 90).is_none());
    }

    /// Every entry the build wrote is found again at run time for its own architecture (its
    /// source hash matches the text the run time compiles), and holds an ELF image.
    #[test]
    fn every_table_entry_matches_the_current_source() {
        for p in TABLE {
            let m = Module::ALL
                .into_iter()
                .find(|m| m.file_name() == p.file)
                .expect("a fixed file");
            let g = m
                .groups()
                .into_iter()
                .find(|g| g.label() == p.group)
                .expect("a group of the file");
            let found = find(m, g, p.arch);
            if enabled() {
                assert!(
                    found.is_some_and(|f| f.arch == p.arch),
                    "{} [{}] sm_{}",
                    p.file,
                    p.group,
                    p.arch
                );
            }
            assert_eq!(&p.cubin.bytes[..4], b"\x7fELF", "{} [{}]", p.file, p.group);
        }
    }
}
