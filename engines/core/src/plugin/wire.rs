//! Requests in C form ([`RawRequest`]): JSON of the request and, beside
//! it, each image's embeddings as floats, which JSON would spell out
//! digit by digit.

use std::marker::PhantomData;
use std::sync::Arc;

use super::abi::{Bytes, Floats, RawRequest};
use crate::request::GenerateRequest;

/// `req` in C form, lent while `req` lives.
pub struct LentRequest<'a> {
    json: Vec<u8>,
    embeddings: Vec<Floats>,
    _request: PhantomData<&'a GenerateRequest>,
}

impl<'a> LentRequest<'a> {
    pub fn new(req: &'a GenerateRequest) -> Result<Self, serde_json::Error> {
        Ok(LentRequest {
            json: serde_json::to_vec(req)?,
            embeddings: req
                .images
                .iter()
                .map(|i| Floats {
                    ptr: i.embeddings.as_ptr(),
                    len: i.embeddings.len(),
                })
                .collect(),
            _request: PhantomData,
        })
    }

    /// Valid while `self` lives.
    pub fn raw(&self) -> RawRequest {
        RawRequest {
            json: Bytes::new(&self.json),
            embeddings: self.embeddings.as_ptr(),
            images: self.embeddings.len(),
        }
    }
}

/// The request `raw` describes, its embeddings copied; its cancel token is
/// a fresh one (the caller sets the one that crossed beside it).
///
/// # Safety
/// `raw`'s pointers are valid for the call.
pub unsafe fn read_request(raw: &RawRequest) -> Result<GenerateRequest, String> {
    let mut req: GenerateRequest = serde_json::from_slice(raw.json.as_slice())
        .map_err(|e| format!("the request does not parse: {e}"))?;
    if req.images.len() != raw.images {
        return Err(format!(
            "the request has {} images but {} embeddings crossed",
            req.images.len(),
            raw.images
        ));
    }
    for (i, image) in req.images.iter_mut().enumerate() {
        let floats = *raw.embeddings.add(i);
        let slice = match floats.len {
            0 => &[][..],
            n => std::slice::from_raw_parts(floats.ptr, n),
        };
        image.embeddings = Arc::new(slice.to_vec());
    }
    Ok(req)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::ImageInput;

    #[test]
    fn a_request_and_its_images_cross_whole() {
        let mut req = GenerateRequest::new(vec![1, 2, 3, 4], 5);
        req.images = vec![
            ImageInput {
                start: 1,
                tokens: 2,
                width: 2,
                embeddings: Arc::new(vec![0.5, -1.0, f32::MIN_POSITIVE, 3.25]),
                bidirectional: true,
            },
            ImageInput {
                start: 3,
                tokens: 1,
                width: 1,
                embeddings: Arc::new(vec![7.0]),
                bidirectional: false,
            },
        ];
        let lent = LentRequest::new(&req).unwrap();
        let back = unsafe { read_request(&lent.raw()) }.unwrap();
        assert_eq!(back.images, req.images);
        assert_eq!((back.id, &back.prompt), (req.id, &req.prompt));
        // The floats are not in the JSON.
        let json = String::from_utf8(lent.json.clone()).unwrap();
        assert!(
            !json.contains("3.25") && !json.contains("embeddings"),
            "{json}"
        );
        // A field from a newer build is passed over (and one it lacks
        // would read as its default): a compatible addition.
        let mut newer: serde_json::Value = serde_json::from_slice(&lent.json).unwrap();
        newer["added_later"] = serde_json::json!({"any": [1, 2]});
        let json = serde_json::to_vec(&newer).unwrap();
        let raw = RawRequest {
            json: Bytes::new(&json),
            ..lent.raw()
        };
        assert_eq!(unsafe { read_request(&raw) }.unwrap().prompt, req.prompt);
        // Embeddings that do not match the images are refused.
        let mut short = lent.raw();
        short.images = 1;
        let e = unsafe { read_request(&short) }.unwrap_err();
        assert!(e.contains("2 images but 1 embeddings"), "{e}");
    }
}
