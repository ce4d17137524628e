//! The one module that names `std::sync`; everything else imports from here.

pub(crate) use std::sync::OnceLock;
