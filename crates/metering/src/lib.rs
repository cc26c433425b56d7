//! metering
