//! Where an `image_url` part's bytes come from: a `data:` URL (base64), or,
//! when the operator allows it, a local file or an http URL. Each source
//! is bounded by `max_image_bytes`; downloads also by `fetch_timeout_s`.

use std::time::Duration;

use base64::Engine as _;
use http_body_util::{BodyExt, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::settings::VisionSettings;
use super::ImageError;

/// Reads the image bytes `url` names.
pub async fn fetch(url: &str, settings: &VisionSettings) -> Result<Vec<u8>, ImageError> {
    if let Some(rest) = url.strip_prefix("data:") {
        return data_url(rest, settings.max_image_bytes);
    }
    if url.starts_with("http://") || url.starts_with("https://") {
        if !settings.allow_remote_urls {
            return Err(ImageError::NotAllowed(
                "image URLs over http are turned off on this server (vision.allow_remote_urls); send the image as a data: URL".into(),
            ));
        }
        if url.starts_with("https://") {
            return Err(ImageError::NotAllowed(
                "https image URLs are not supported (this build has no TLS client); send the image as a data: URL".into(),
            ));
        }
        return download(url, settings).await;
    }
    let path = url.strip_prefix("file://").unwrap_or(url);
    if path.starts_with('/') {
        if !settings.allow_local_files {
            return Err(ImageError::NotAllowed(
                "local image files are turned off on this server (vision.allow_local_files); send the image as a data: URL".into(),
            ));
        }
        return local_file(path, settings.max_image_bytes).await;
    }
    Err(ImageError::Invalid(
        "`url` must be a data: URL (data:image/png;base64,...), an http URL or an absolute file path".into(),
    ))
}

fn data_url(rest: &str, limit: usize) -> Result<Vec<u8>, ImageError> {
    let (meta, payload) = rest
        .split_once(',')
        .ok_or_else(|| ImageError::Invalid("the data: URL has no `,` before its data".into()))?;
    if !meta.ends_with(";base64") {
        return Err(ImageError::Invalid(
            "the data: URL must be base64-encoded (data:image/png;base64,...)".into(),
        ));
    }
    // Base64 is 4 characters per 3 bytes: reject before decoding.
    if payload.len() / 4 * 3 > limit + 3 {
        return Err(ImageError::TooLarge(format!(
            "the image is larger than the limit of {limit} bytes"
        )));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(payload.trim())
        .map_err(|e| ImageError::Invalid(format!("the data: URL is not valid base64: {e}")))?;
    check_size(bytes.len(), limit)?;
    Ok(bytes)
}

fn check_size(len: usize, limit: usize) -> Result<(), ImageError> {
    if len > limit {
        return Err(ImageError::TooLarge(format!(
            "the image is larger than the limit of {limit} bytes"
        )));
    }
    Ok(())
}

async fn local_file(path: &str, limit: usize) -> Result<Vec<u8>, ImageError> {
    let meta = tokio::fs::metadata(path)
        .await
        .map_err(|e| ImageError::Invalid(format!("cannot read the image file {path}: {e}")))?;
    if !meta.is_file() {
        return Err(ImageError::Invalid(format!("{path} is not a file")));
    }
    check_size(meta.len() as usize, limit)?;
    let bytes = tokio::fs::read(path)
        .await
        .map_err(|e| ImageError::Invalid(format!("cannot read the image file {path}: {e}")))?;
    check_size(bytes.len(), limit)?;
    Ok(bytes)
}

async fn download(url: &str, settings: &VisionSettings) -> Result<Vec<u8>, ImageError> {
    let uri: hyper::Uri = url
        .parse()
        .map_err(|e| ImageError::Invalid(format!("invalid image URL: {e}")))?;
    let client: Client<_, http_body_util::Empty<bytes::Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let limit = settings.max_image_bytes;
    let timeout = Duration::from_secs_f64(settings.fetch_timeout_s);
    let work = async {
        let response = client
            .get(uri)
            .await
            .map_err(|e| ImageError::Fetch(format!("cannot download the image: {e}")))?;
        if !response.status().is_success() {
            return Err(ImageError::Fetch(format!(
                "downloading the image returned HTTP {}",
                response.status()
            )));
        }
        let body = Limited::new(response.into_body(), limit)
            .collect()
            .await
            .map_err(|e| {
                if e.is::<http_body_util::LengthLimitError>() {
                    ImageError::TooLarge(format!(
                        "the image is larger than the limit of {limit} bytes"
                    ))
                } else {
                    ImageError::Fetch(format!("downloading the image failed: {e}"))
                }
            })?;
        Ok(body.to_bytes().to_vec())
    };
    tokio::time::timeout(timeout, work).await.map_err(|_| {
        ImageError::Fetch(format!(
            "downloading the image took longer than {} seconds",
            settings.fetch_timeout_s
        ))
    })?
}
