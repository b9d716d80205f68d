//! The few messages of Dapr's `dapr.proto.runtime.v1` that fencer serves,
//! written by hand with prost's derive (field numbers as in Dapr's
//! `lock.proto` and `metadata.proto`), so the build needs no protoc.
//! Fields fencer never fills are left out: proto3 readers treat a missing
//! field as its default.

use std::collections::BTreeMap;

#[derive(Clone, PartialEq, prost::Message)]
pub struct TryLockRequest {
    #[prost(string, tag = "1")]
    pub store_name: String,
    #[prost(string, tag = "2")]
    pub resource_id: String,
    #[prost(string, tag = "3")]
    pub lock_owner: String,
    #[prost(int32, tag = "4")]
    pub expiry_in_seconds: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TryLockResponse {
    #[prost(bool, tag = "1")]
    pub success: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct UnlockRequest {
    #[prost(string, tag = "1")]
    pub store_name: String,
    #[prost(string, tag = "2")]
    pub resource_id: String,
    #[prost(string, tag = "3")]
    pub lock_owner: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct UnlockResponse {
    /// `UnlockResponse.Status`: an enum on the wire is its int32.
    #[prost(int32, tag = "1")]
    pub status: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct GetMetadataRequest {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct GetMetadataResponse {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(message, repeated, tag = "3")]
    pub registered_components: Vec<RegisteredComponents>,
    #[prost(btree_map = "string, string", tag = "4")]
    pub extended_metadata: BTreeMap<String, String>,
    #[prost(string, tag = "8")]
    pub runtime_version: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RegisteredComponents {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub r#type: String,
    #[prost(string, tag = "3")]
    pub version: String,
    #[prost(string, repeated, tag = "4")]
    pub capabilities: Vec<String>,
}
