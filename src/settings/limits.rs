//! Hard bounds shared by config validation and request validation: a leaf
//! module, so request handlers need not import the whole configuration.

pub const MIN_TTL_MS: u64 = 100;
pub const MAX_TTL_MS: u64 = 3_600_000;
pub const MAX_WAIT_MS: u64 = 300_000;
pub const MAX_KEY_BYTES: usize = 512;
pub const MAX_OWNER_BYTES: usize = 256;
pub const MAX_BODY_BYTES: usize = 16 * 1024;
