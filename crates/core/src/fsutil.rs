//! Writing files so that nothing is lost on the way to disk.
//!
//! Why: a checkpoint written in place is truncated first and filled afterwards, so a crash, a
//! full disk or an error halfway through destroys the previous checkpoint along with the new
//! one. [`write_atomically`] writes to a temporary file in the target's directory (the same
//! filesystem, so that a rename can replace the target in one step), flushes it, `sync_all`s it
//! to the disk, and only then renames it over the target; on Unix it then syncs the directory so
//! that the rename itself survives a power loss. A reader sees the old file or the new one,
//! never a mixture, and one that opened the old file keeps reading it whole. On any failure
//! (the writer's, the disk's, or a panic in the caller's closure) the temporary file is removed
//! and the target is left as it was.
//!
//! The new file takes the old one's permissions when there was one; its other metadata (owner,
//! extended attributes, hard links) are those of a new file, as with any save-by-rename editor.

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Error, Result};

/// Writes the file at `path` through `write`, atomically (see the module docs): either the whole
/// new contents land at `path`, or `path` keeps its previous contents (or stays absent) and no
/// temporary file remains.
///
/// `write` gets a buffered writer; an I/O error from it can be turned into a kiln error with
/// [`io_error`]. A failure to create, sync or rename the file is an [`Error::Io`] naming `path`.
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("kiln_fsutil_doc_{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// use kiln_core::fsutil::{io_error, write_atomically};
/// let path = dir.join("notes.txt");
/// write_atomically(&path, |w| w.write_all(b"all or nothing").map_err(io_error(&path)))?;
/// assert_eq!(std::fs::read(&path).unwrap(), b"all or nothing");
/// # std::fs::remove_dir_all(&dir).unwrap();
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn write_atomically(
    path: impl AsRef<Path>,
    write: impl FnOnce(&mut dyn Write) -> Result<()>,
) -> Result<()> {
    let path = path.as_ref();
    let io = io_error(path);
    let (tmp, file) = create_temp(path).map_err(&io)?;
    // Removes the temporary file on every way out (an error or a panic) until disarmed.
    let mut guard = TempGuard(Some(tmp));
    // Keep the permissions of the file being replaced (a fresh file would get the umask's).
    if let Ok(meta) = fs::metadata(path) {
        file.set_permissions(meta.permissions()).map_err(&io)?;
    }
    let mut w = BufWriter::with_capacity(1 << 20, file);
    write(&mut w)?;
    let file = w.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(&io)?;
    drop(file);
    let tmp = guard.0.as_deref().expect("armed until the rename");
    fs::rename(tmp, path).map_err(&io)?;
    guard.0 = None;
    sync_dir(path);
    Ok(())
}

/// Maps an I/O error while writing `path` to [`Error::Io`] naming it.
pub fn io_error(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.display().to_string(),
        source,
    }
}

/// A new, empty temporary file beside `path`: `.{name}.tmp-{pid}-{n}`, created exclusively so
/// that two saves at once never share one.
fn create_temp(path: &Path) -> std::io::Result<(PathBuf, File)> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path names no file")
    })?;
    let dir = parent(path);
    loop {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(".tmp-{}-{n}", std::process::id()));
        let tmp = dir.join(tmp_name);
        match OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            // Left behind by a process with the same id that crashed: take the next number.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

/// The directory `path` lies in (`.` for a bare file name).
fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Makes the rename durable (Unix: the directory entry lives in the directory's own blocks).
/// Best effort: the new file is already complete and in place, and some filesystems refuse to
/// open or sync a directory.
fn sync_dir(path: &Path) {
    #[cfg(unix)]
    if let Ok(d) = File::open(parent(path)) {
        let _ = d.sync_all();
    }
    #[cfg(not(unix))]
    let _ = path;
}

struct TempGuard(Option<PathBuf>);

impl Drop for TempGuard {
    fn drop(&mut self) {
        if let Some(tmp) = self.0.take() {
            let _ = fs::remove_file(tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory for one test.
    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kiln_fsutil_{name}_{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    fn write_bytes(path: &Path, bytes: &[u8]) -> Result<()> {
        write_atomically(path, |w| w.write_all(bytes).map_err(io_error(path)))
    }

    #[test]
    fn writes_and_replaces_whole_files() {
        let d = scratch("replace");
        let p = d.join("a.bin");
        write_bytes(&p, b"first").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"first");
        write_bytes(&p, b"second, longer").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"second, longer");
        write_bytes(&p, b"3").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"3");
        assert_eq!(entries(&d), ["a.bin"], "no temporary file remains");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_failure_midway_keeps_the_previous_file() {
        let d = scratch("midway");
        let p = d.join("ckpt");
        write_bytes(&p, b"previous checkpoint").unwrap();
        let e = write_atomically(&p, |w| {
            w.write_all(b"half of a new").map_err(io_error(&p))?;
            w.flush().map_err(io_error(&p))?;
            Err(Error::invalid("save", "the writer failed midway"))
        })
        .unwrap_err();
        assert!(e.to_string().contains("midway"), "{e}");
        assert_eq!(fs::read(&p).unwrap(), b"previous checkpoint");
        assert_eq!(entries(&d), ["ckpt"], "the temporary file was removed");
        // And with no previous file, none appears.
        let q = d.join("new");
        assert!(write_atomically(&q, |_| Err(Error::invalid("save", "no"))).is_err());
        assert_eq!(entries(&d), ["ckpt"]);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_panic_midway_keeps_the_previous_file() {
        let d = scratch("panic");
        let p = d.join("ckpt");
        write_bytes(&p, b"previous").unwrap();
        let r = std::panic::catch_unwind(|| {
            write_atomically(&p, |w| {
                w.write_all(b"partial").unwrap();
                panic!("the caller's code panicked");
            })
        });
        assert!(r.is_err());
        assert_eq!(fs::read(&p).unwrap(), b"previous");
        assert_eq!(entries(&d), ["ckpt"]);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_failed_rename_leaves_no_temporary_file() {
        let d = scratch("rename");
        // The target is a non-empty directory: everything but the rename succeeds.
        let p = d.join("taken");
        fs::create_dir_all(p.join("inside")).unwrap();
        let e = write_bytes(&p, b"data").unwrap_err();
        assert!(
            matches!(&e, Error::Io { path, .. } if path.ends_with("taken")),
            "{e}"
        );
        assert_eq!(entries(&d), ["taken"]);
        assert!(p.join("inside").is_dir());
        // A directory that does not exist: an Io error naming the path.
        let missing = d.join("no/such/dir/file");
        let e = write_bytes(&missing, b"x").unwrap_err();
        assert!(
            matches!(&e, Error::Io { path, .. } if path.contains("no/such")),
            "{e}"
        );
        fs::remove_dir_all(&d).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn readers_of_the_old_file_keep_it_and_permissions_carry_over() {
        use std::io::Read;
        use std::os::unix::fs::PermissionsExt;
        let d = scratch("readers");
        let p = d.join("ckpt");
        write_bytes(&p, b"old contents").unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(0o640)).unwrap();
        let mut old = File::open(&p).unwrap();
        write_bytes(&p, b"new").unwrap();
        // In-place writing would have truncated what `old` reads.
        let mut s = String::new();
        old.read_to_string(&mut s).unwrap();
        assert_eq!(s, "old contents");
        assert_eq!(fs::read(&p).unwrap(), b"new");
        assert_eq!(
            fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o640
        );
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_bare_file_name_lands_in_the_current_directory() {
        assert_eq!(parent(Path::new("x.bin")), Path::new("."));
        assert_eq!(parent(Path::new("a/x.bin")), Path::new("a"));
        assert!(write_atomically("/", |_| Ok(())).is_err(), "no file name");
    }
}
