//! The one error type of kiln.
//!
//! Every fallible public function returns [`Result`]. Each variant names the op that failed and
//! what was wrong with its input, so a message read in a log says what to fix without a backtrace.

use crate::{DType, Shape};

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Two shapes that had to agree (or broadcast) do not.
    #[error("{op}: shape mismatch between {lhs} and {rhs}")]
    ShapeMismatch {
        op: &'static str,
        lhs: Shape,
        rhs: Shape,
    },
    /// Inputs live on different devices. Nothing is copied behind the user's back.
    #[error(
        "{op}: inputs are on different devices ({lhs} and {rhs}); copy one with to_device first"
    )]
    DeviceMismatch {
        op: &'static str,
        lhs: String,
        rhs: String,
    },
    /// A device name that does not parse ([`DeviceSpec::parse`](crate::DeviceSpec::parse)), or
    /// that names another backend's device. `expected` says what would have been accepted.
    #[error("{op}: `{name}` is not {expected}")]
    BadDevice {
        op: &'static str,
        name: String,
        expected: &'static str,
    },
    /// Inputs have different dtypes, or a dtype the op does not support.
    #[error("{op}: dtype mismatch: expected {expected}, got {got}")]
    DTypeMismatch {
        op: &'static str,
        expected: String,
        got: DType,
    },
    /// An axis outside `-rank..rank`.
    #[error("{op}: axis {axis} is out of range for a tensor of rank {rank}")]
    AxisOutOfRange {
        op: &'static str,
        axis: isize,
        rank: usize,
    },
    /// A reshape to a shape with a different number of elements.
    #[error("{op}: cannot reshape {from} ({} elements) into {to} ({} elements)", from.elem_count(), to.elem_count())]
    BadReshape {
        op: &'static str,
        from: Shape,
        to: Shape,
    },
    /// An index (`index_select`, `gather`, `scatter_add`) outside its axis `0..size`, or a
    /// class label of a cross-entropy outside `0..size` (`size` is then the number of
    /// classes). Every backend reports it with this variant, the GPU's included (from its
    /// kernels' error flag), so a caller can match it.
    #[error("{op}: index {index} is out of range 0..{size}")]
    IndexOutOfRange {
        op: &'static str,
        index: i64,
        size: usize,
    },
    /// Any other invalid argument, described in `msg`.
    #[error("{op}: {msg}")]
    InvalidArgument { op: &'static str, msg: String },
    /// A device allocation failed even after the cache was trimmed.
    #[error(
        "out of memory on {device}: tried to allocate {requested} bytes ({} MiB); {held} bytes are held by kiln on that device{}",
        requested / (1 << 20),
        if msg.is_empty() { String::new() } else { format!(" ({msg})") }
    )]
    OutOfMemory {
        device: String,
        requested: usize,
        held: usize,
        msg: String,
    },
    /// A failure reported by a backend library (the driver, cuBLAS, NVRTC, NCCL).
    #[error("{op}: backend error: {msg}")]
    Backend { op: &'static str, msg: String },
    /// A file that could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// An expression program (module `expr`) that is malformed, or that does not fit the
    /// inputs and parameters it was given. `op` is the instruction's op (`exp`, `add`, `sum`,
    /// ...) or `expr` for the program as a whole; `kind` says what class of mistake it is.
    #[error("{op}: {kind}: {msg}")]
    Expr {
        op: &'static str,
        kind: ExprErrorKind,
        msg: String,
    },
    /// A file that was read but whose contents are invalid (bad magic, truncated, wrong sizes).
    #[error("{path}: corrupt or invalid file: {msg}")]
    Corrupt { path: String, msg: String },
    /// A failure of distributed work (rendezvous, a collective, a peer rank, data-parallel
    /// bookkeeping); `kind` says which class, so callers and tests can react to it.
    #[error("{op}: {kind}: {msg}")]
    Distributed {
        op: &'static str,
        kind: DistErrorKind,
        msg: String,
    },
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(op: &'static str, msg: impl Into<String>) -> Self {
        Error::InvalidArgument {
            op,
            msg: msg.into(),
        }
    }

    /// Shorthand for [`Error::Distributed`].
    pub fn dist(op: &'static str, kind: DistErrorKind, msg: impl std::fmt::Display) -> Self {
        Error::Distributed {
            op,
            kind,
            msg: msg.to_string(),
        }
    }

    /// The class of a distributed failure, `None` for every other error.
    pub fn dist_kind(&self) -> Option<DistErrorKind> {
        match self {
            Error::Distributed { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// Shorthand for [`Error::Backend`].
    pub fn backend(op: &'static str, msg: impl std::fmt::Display) -> Self {
        Error::Backend {
            op,
            msg: msg.to_string(),
        }
    }
}

/// The class of an [`Error::Distributed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DistErrorKind {
    /// A process's place (`RANK`, `WORLD_SIZE`, ...) is missing or malformed.
    Environment,
    /// The rendezvous did not complete: rank 0 unreachable, or ranks missing at the deadline.
    Rendezvous,
    /// A collective or the communicator's setup did not finish within the timeout.
    Timeout,
    /// A peer rank went away (its connection closed, NCCL reported a remote error).
    PeerLost,
    /// The communication library reported an error (or is not installed).
    Library,
    /// The communicator was aborted earlier (after a timeout or an error); it is unusable.
    Aborted,
    /// Data-parallel bookkeeping found a mismatch (a parameter without a gradient, ranks that
    /// disagree on the model).
    Mismatch,
}

impl std::fmt::Display for DistErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DistErrorKind::Environment => "bad launch environment",
            DistErrorKind::Rendezvous => "rendezvous failed",
            DistErrorKind::Timeout => "timed out",
            DistErrorKind::PeerLost => "peer rank lost",
            DistErrorKind::Library => "communication library error",
            DistErrorKind::Aborted => "communicator aborted",
            DistErrorKind::Mismatch => "ranks disagree",
        })
    }
}

/// The class of an [`Error::Expr`], for code that reacts to it (and for tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExprErrorKind {
    /// The wrong number of inputs, parameters or outputs.
    Arity,
    /// An operand of a dtype the op does not take, or operands whose dtypes disagree.
    DType,
    /// Inputs whose shapes do not broadcast together, or a layout of the wrong shape.
    Shape,
    /// An axis outside the iteration shape's rank, or given twice.
    Axis,
    /// Elementwise and reduced values mixed in one op, a reduction of a reduced value, or two
    /// different sets of reduction axes in one program.
    Phase,
    /// A reference to a value not yet defined, an empty program, an empty reduction with no
    /// identity: anything else malformed.
    Structure,
}

impl std::fmt::Display for ExprErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ExprErrorKind::Arity => "arity",
            ExprErrorKind::DType => "dtype",
            ExprErrorKind::Shape => "shape",
            ExprErrorKind::Axis => "axis",
            ExprErrorKind::Phase => "phase",
            ExprErrorKind::Structure => "structure",
        })
    }
}
