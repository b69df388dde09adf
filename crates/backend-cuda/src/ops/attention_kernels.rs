//! The families of fused-attention kernels (`kernels/attention.cu`'s f32-FMA ones and
//! `kernels/attention_tc.cu`'s tensor-core ones: 16-bit, and f32 as 3xTF32 or 1xTF32): which
//! one runs a call, their names, block sizes and shared memory, and their launch.
//! `attention.rs` packs the arguments, which all families take alike.
//!
//! # Why a module of its own
//!
//! It keeps `attention.rs` about the problem (operands, strides, shapes) and below ~500
//! lines, and puts everything that must match a kernel file's tile layout in one place.

use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys;

use kiln_core::{DType, Result};

use crate::device::{DeviceState, check};
use crate::launch::Args;
use crate::ops::{Module, tname};

/// Queries (and keys) per tile of the FMA kernels; `ATT_B` of `attention.cu`.
pub(super) const TILE: usize = 32;
/// Queries per block of the tensor-core forward and dQ, keys per block of their dK/dV;
/// `TC_BQ` of `attention_tc.cu`.
const TC_TILE: usize = 64;
/// Threads per block of both kernel files (`ATT_NT`, `TC_NT`).
const THREADS: u32 = 128;
/// Shared memory a kernel gets without opting in.
const DEFAULT_SMEM: usize = 48 * 1024;

/// Whether fused f16/bf16 attention takes the tensor-core kernels where the device has them.
static TENSOR_CORES: AtomicBool = AtomicBool::new(true);
/// Whether fused f32 attention takes the TF32 tensor-core kernels where the device has them.
static TENSOR_CORES_F32: AtomicBool = AtomicBool::new(true);

/// Lets fused f16/bf16 attention use the tensor-core kernels on sm_80+ (`true`, the default)
/// or keeps it on the f32-FMA kernels (`false`: for comparing the two). Process-wide.
pub fn set_attention_tensor_cores(on: bool) {
    TENSOR_CORES.store(on, Ordering::Relaxed);
}

/// Lets fused f32 attention use the TF32 tensor-core kernels on sm_80+ (`true`, the default:
/// 3xTF32, near-f32 results as PyTorch's; 1xTF32 while [`crate::allow_tf32`] is on) or
/// forces the f32-FMA kernels (`false`: for comparing the two). Process-wide.
pub fn set_attention_tensor_cores_f32(on: bool) {
    TENSOR_CORES_F32.store(on, Ordering::Relaxed);
}

/// The kernel families.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Family {
    /// `attention.cu`: f32 FMAs, any float dtype.
    Fma,
    /// `attention_tc.cu`: `mma.sync` on 16-bit operands, sm_80+.
    TensorCore,
    /// `attention_tc.cu` on f32 operands: TF32 `mma.sync`, sm_80+; three products per tile
    /// (3xTF32, `true`) or one (1xTF32, `false`).
    Tf32(bool),
}

/// The three kernels of a family that take a head-size tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    Fwd,
    DkDv,
    Dq,
}

impl Family {
    /// The family that runs `dtype` at head size `dt` on a device of compute capability
    /// `arch` that gives a block at most `smem_optin` bytes of shared memory, with TF32
    /// allowed (`tf32`: `crate::allow_tf32()`, read by the caller) or not: f32 takes the TF32
    /// kernels only where all three of their stages fit (not at head size 128 on the 99 KiB
    /// of sm_86/sm_89).
    pub(super) fn of(
        dtype: DType,
        dt: usize,
        (arch, smem_optin): (u32, usize),
        tf32: bool,
    ) -> Family {
        let half = matches!(dtype, DType::F16 | DType::BF16);
        if half && arch >= 80 && TENSOR_CORES.load(Ordering::Relaxed) {
            return Family::TensorCore;
        }
        let tf32 = Family::Tf32(!tf32);
        if dtype == DType::F32
            && arch >= 80
            && TENSOR_CORES_F32.load(Ordering::Relaxed)
            && [Stage::Fwd, Stage::DkDv, Stage::Dq]
                .iter()
                .all(|&s| tf32.smem_bytes(s, dt) <= smem_optin)
        {
            return tf32;
        }
        Family::Fma
    }

    fn module(self) -> Module {
        match self {
            Family::Fma => Module::Attention,
            Family::TensorCore | Family::Tf32(_) => Module::AttentionTc,
        }
    }

    fn kernel(self, stage: Stage) -> &'static str {
        match (self, stage) {
            (Family::Fma, Stage::Fwd) => "attn_fwd",
            (Family::Fma, Stage::DkDv) => "attn_bwd_dkdv",
            (Family::Fma, Stage::Dq) => "attn_bwd_dq",
            (Family::TensorCore, Stage::Fwd) => "attn_tc_fwd",
            (Family::TensorCore, Stage::DkDv) => "attn_tc_dkdv",
            (Family::TensorCore, Stage::Dq) => "attn_tc_dq",
            (Family::Tf32(true), Stage::Fwd) => "attn_tf32x3_fwd",
            (Family::Tf32(true), Stage::DkDv) => "attn_tf32x3_dkdv",
            (Family::Tf32(true), Stage::Dq) => "attn_tf32x3_dq",
            (Family::Tf32(false), Stage::Fwd) => "attn_tf32_fwd",
            (Family::Tf32(false), Stage::DkDv) => "attn_tf32_dkdv",
            (Family::Tf32(false), Stage::Dq) => "attn_tf32_dq",
        }
    }

    /// Rows of the stationary side per block (queries of Fwd/Dq, keys of DkDv).
    pub(super) fn block_rows(self) -> usize {
        match self {
            Family::Fma => TILE,
            Family::TensorCore | Family::Tf32(_) => TC_TILE,
        }
    }

    /// The tensor-core formats' `Side` (`attention_tc.cu`) at head size `dt`: the key tile of the
    /// forward and dQ, the query tile of dK/dV; `None` for the FMA kernels.
    pub(super) fn side(self, dt: usize) -> Option<usize> {
        match self {
            Family::Fma => None,
            Family::TensorCore => Some(if dt == 64 { 64 } else { 32 }),
            Family::Tf32(_) => Some(32),
        }
    }

    /// The bytes of the dropout bits the tensor-core forward keeps for `batch` entries of `tq`
    /// queries and `tk` keys at head size `dt` (`attention_tc.cu`'s `tc_mask_word`: two words
    /// per key of a key tile per 64-query block); `None` for the FMA kernels, which keep none.
    pub(super) fn mask_bytes(
        self,
        dt: usize,
        (batch, tq, tk): (usize, usize, usize),
    ) -> Option<usize> {
        let side = self.side(dt)?;
        Some(batch * tq.div_ceil(TC_TILE) * tk.div_ceil(side) * 2 * side * 4)
    }

    /// Shared memory of `stage` for head size `dt` (in bytes), as the kernel file lays it out.
    fn smem_bytes(self, stage: Stage, dt: usize) -> usize {
        match self {
            Family::Fma => {
                // f32 tiles of [TILE][dt + 1] and [TILE][TILE + 1].
                let tile = TILE * (dt + 1);
                let square = TILE * (TILE + 1);
                4 * match stage {
                    Stage::Fwd => 3 * tile + square,
                    Stage::Dq => 4 * tile + square,
                    Stage::DkDv => 4 * tile + 2 * square + 2 * TILE,
                }
            }
            Family::TensorCore | Family::Tf32(_) => {
                // Tiles of the storage type with a row pitch of dt elements and 16 bytes
                // (TcPitch): TC_TILE stationary rows (Q; K and V; Q and dO), two buffers of
                // `side` rows (the format's Side) of each operand the block loops over (K and
                // V; Q and dO; K and V), and in DkDv two f32 per query of each buffer (lse, Dr).
                let side = self.side(dt).unwrap_or(TILE);
                let row = match self {
                    Family::TensorCore => 2 * dt + 16,
                    _ => 4 * dt + 16,
                };
                match stage {
                    Stage::Fwd => (TC_TILE + 4 * side) * row,
                    Stage::Dq => (2 * TC_TILE + 4 * side) * row,
                    Stage::DkDv => (2 * TC_TILE + 4 * side) * row + 4 * side * 4,
                }
            }
        }
    }
}

/// The dtype part of the kernels' names: the storage type, or with a boolean mask (`keep`)
/// its `_keep` instances, which compile in a group of their own (`kernel_files.rs`).
fn tag(dtype: DType, keep: bool) -> Result<&'static str> {
    Ok(match (tname(dtype), keep) {
        (t, false) => t,
        ("float", true) => "float_keep",
        ("f16", true) => "f16_keep",
        ("bf16", true) => "bf16_keep",
        (t, true) => {
            return Err(kiln_core::Error::backend(
                "scaled_dot_product_attention",
                format!("no boolean-mask kernels for {t}"),
            ));
        }
    })
}

/// Launches `stage` of `family` for `dtype` and head size `tile` over `grid` (batch, blocks),
/// with a boolean mask's instances when `keep`, opting in to more than 48 KiB of shared memory
/// where the kernel needs it.
pub(super) fn launch(
    dev: &DeviceState,
    (family, stage, keep): (Family, Stage, bool),
    dtype: DType,
    (tile, dt): (&'static str, usize),
    grid: (u32, u32),
    args: &mut Args,
) -> Result<()> {
    const OP: &str = "scaled_dot_product_attention";
    let f = dev.func(
        family.module(),
        &[family.kernel(stage), tag(dtype, keep)?, tile],
    )?;
    let smem = family.smem_bytes(stage, dt);
    if smem > DEFAULT_SMEM {
        // SAFETY: `f` is a kernel of the current context (bound by the caller); the attribute
        // is a plain integer setting of that function.
        check(
            unsafe {
                sys::cuFuncSetAttribute(
                    f.0,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
            },
            OP,
        )?;
    }
    dev.launch(OP, f, grid, THREADS, smem as u32, args.ptrs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_fits_the_devices() {
        // The FMA kernels below 48 KiB at head size 64 (no opt-in); all below the 99 KiB of an
        // sm_86 block. The tensor-core forward at 64 (the GPT shape's) needs no opt-in either.
        for k in [Stage::Fwd, Stage::Dq, Stage::DkDv] {
            assert!(Family::Fma.smem_bytes(k, 64) <= DEFAULT_SMEM, "{k:?}");
            for f in [Family::Fma, Family::TensorCore] {
                for dt in [64, 128] {
                    assert!(f.smem_bytes(k, dt) <= 99 * 1024, "{f:?} {k:?} {dt}");
                }
            }
        }
        assert_eq!(Family::TensorCore.smem_bytes(Stage::Fwd, 64), 46080);
        // f32: [64][68] + 4 [32][68] floats; DkDv at 128 fits an A100's or H100's block.
        assert_eq!(Family::Tf32(true).smem_bytes(Stage::Fwd, 64), 52224);
        assert!(Family::Tf32(true).smem_bytes(Stage::DkDv, 128) <= 163 * 1024);
    }

    #[test]
    fn tensor_cores_take_16_bit_and_f32_on_sm80_and_up_only() {
        const H100: usize = 227 * 1024;
        const SM86: usize = 99 * 1024;
        assert_eq!(
            Family::of(DType::BF16, 64, (90, H100), false),
            Family::TensorCore
        );
        assert_eq!(
            Family::of(DType::F16, 128, (80, H100), false),
            Family::TensorCore
        );
        assert_eq!(
            Family::of(DType::BF16, 64, (75, 64 * 1024), false),
            Family::Fma
        );
        assert_eq!(
            Family::of(DType::F32, 64, (75, 64 * 1024), false),
            Family::Fma
        );
        // 3xTF32 by default, 1xTF32 with TF32 allowed.
        assert_eq!(
            Family::of(DType::F32, 64, (90, H100), false),
            Family::Tf32(true)
        );
        assert_eq!(
            Family::of(DType::F32, 64, (80, H100), true),
            Family::Tf32(false)
        );
        assert!(matches!(
            Family::of(DType::F32, 128, (90, H100), false),
            Family::Tf32(_)
        ));
        assert!(matches!(
            Family::of(DType::F32, 64, (86, SM86), false),
            Family::Tf32(_)
        ));
        assert_eq!(Family::of(DType::F32, 128, (86, SM86), false), Family::Fma);
        assert_eq!(Family::of(DType::F64, 64, (90, H100), false), Family::Fma);
    }
}
