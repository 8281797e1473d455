//! The lock that serialises device work across engines: MLX streams are
//! not safe to evaluate from several threads at once. The host holds the
//! lock ([`LocalDeviceLock`]); a plugin takes the host's through C
//! (`abi::foreign`).

use std::sync::{Condvar, Mutex};

/// Exclusive use of the device, taken and given back explicitly (the C
/// form has no guards); [`lock`] gives a guard.
pub trait DeviceLock: Send + Sync {
    /// Waits until the device is free and takes it.
    fn acquire(&self);
    /// Gives back a device taken with [`DeviceLock::acquire`].
    fn release(&self);
}

/// Holds the device until dropped.
pub struct DeviceGuard<'a>(&'a dyn DeviceLock);

impl Drop for DeviceGuard<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

pub fn lock(device: &dyn DeviceLock) -> DeviceGuard<'_> {
    device.acquire();
    DeviceGuard(device)
}

/// The host's lock.
#[derive(Default)]
pub struct LocalDeviceLock {
    locked: Mutex<bool>,
    free: Condvar,
}

// A panicked holder left nothing half-written that matters here, so
// poisoning is ignored.
impl DeviceLock for LocalDeviceLock {
    fn acquire(&self) {
        let mut held = self.locked.lock().unwrap_or_else(|p| p.into_inner());
        while *held {
            held = self.free.wait(held).unwrap_or_else(|p| p.into_inner());
        }
        *held = true;
    }

    fn release(&self) {
        *self.locked.lock().unwrap_or_else(|p| p.into_inner()) = false;
        self.free.notify_one();
    }
}
