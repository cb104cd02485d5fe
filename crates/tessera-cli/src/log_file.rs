//! A long-running process's log in a file it rotates itself by size
//! (`--log-file`): past `--log-file-max-bytes`, `PATH` becomes `PATH.1`,
//! `PATH.1` becomes `PATH.2` and so on, the oldest beyond
//! `--log-files-kept` is deleted, and a new `PATH` is opened.
//!
//! The file is also the process's stdout and stderr (dup2), so that what it
//! writes outside the logger, a panic's message say, lands in the current
//! file too; `cluster up` starts its processes this way.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use tracing_subscriber::fmt::MakeWriter;

pub struct LogFile {
    path: PathBuf,
    bytes_max: u64,
    kept: usize,
    /// Bytes in the current file.
    written: AtomicU64,
    /// Held while rotating: one thread rotates, the others write on.
    rotating: Mutex<()>,
}

impl LogFile {
    /// Appends to `path` from now on, rotating past `bytes_max` and keeping
    /// `kept` earlier files.
    pub fn open(path: &Path, bytes_max: u64, kept: usize) -> io::Result<Self> {
        if bytes_max == 0 || kept == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a log file needs a size limit and one file kept",
            ));
        }
        let file = append(path)?;
        redirect_output(&file)?;
        let written = AtomicU64::new(file.metadata()?.len());
        Ok(Self { path: path.to_path_buf(), bytes_max, kept, written, rotating: Mutex::new(()) })
    }

    fn numbered(&self, number: usize) -> PathBuf {
        let mut name = self.path.clone().into_os_string();
        name.push(format!(".{number}"));
        PathBuf::from(name)
    }

    /// Counts `bytes` just written; past the limit, one writer rotates.
    fn wrote(&self, bytes: usize) {
        let written = self.written.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        if written < self.bytes_max {
            return;
        }
        let Ok(_rotating) = self.rotating.try_lock() else { return };
        if self.written.load(Ordering::Relaxed) < self.bytes_max {
            return; // another writer rotated meanwhile
        }
        if let Err(error) = self.rotate() {
            // Keep logging to the file as it is rather than lose the log.
            let _ = writeln!(io::stderr(), "cannot rotate the log {}: {error}", self.path.display());
            self.written.store(0, Ordering::Relaxed);
        }
    }

    fn rotate(&self) -> io::Result<()> {
        match std::fs::remove_file(self.numbered(self.kept)) {
            Err(error) if error.kind() != io::ErrorKind::NotFound => return Err(error),
            _ => {}
        }
        for number in (1..self.kept).rev() {
            match std::fs::rename(self.numbered(number), self.numbered(number + 1)) {
                Err(error) if error.kind() != io::ErrorKind::NotFound => return Err(error),
                _ => {}
            }
        }
        std::fs::rename(&self.path, self.numbered(1))?;
        redirect_output(&append(&self.path)?)?;
        self.written.store(0, Ordering::Relaxed);
        Ok(())
    }
}

fn append(path: &Path) -> io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

/// Makes `file` the process's stdout and stderr.
fn redirect_output(file: &File) -> io::Result<()> {
    for target in [libc::STDOUT_FILENO, libc::STDERR_FILENO] {
        // SAFETY: dup2 on two open descriptors; it closes the old target
        // atomically, and `file` stays open (the duplicate outlives it).
        if unsafe { libc::dup2(file.as_raw_fd(), target) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The logger writes each event to stderr (the file), counted.
impl Write for &LogFile {
    fn write(&mut self, buffer: &[u8]) -> io::Result<usize> {
        let written = io::stderr().write(buffer)?;
        self.wrote(written);
        Ok(written)
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stderr().flush()
    }
}

impl<'a> MakeWriter<'a> for LogFile {
    type Writer = &'a LogFile;

    fn make_writer(&'a self) -> Self::Writer {
        self
    }
}
