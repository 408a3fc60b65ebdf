//! The conformance suite against the soft provider's table, in process.

mod conformance;

conformance::suite!(conformance::Backend::Soft);
