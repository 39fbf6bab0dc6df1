//! [`NoIommu`]: the IOMMU-control capability this backend does not have (an
//! uninhabited type: no value exists, [`nprdma::nic::Nic::iommu`] is `None`).

use nprdma::nic::{Access, Frame, IommuControl};

use crate::mr::VerbsMr;
use crate::Error;

/// No IOMMU control (uninhabited).
#[derive(Debug)]
pub enum NoIommu {}

/// No IOVA range (uninhabited).
#[derive(Debug, Clone, Copy)]
pub enum NoRange {}

impl IommuControl for NoIommu {
    type Error = Error;
    type Range = NoRange;
    type Mr = VerbsMr;
    const ENTRY_BYTES: usize = 0;
    fn alloc_range(&self, _npages: u64) -> Result<NoRange, Error> {
        match *self {}
    }
    fn free_range(&self, range: NoRange) -> Result<(), Error> {
        match range {}
    }
    fn map(&self, range: &NoRange, _index: u64, _frame: Frame) -> Result<(), Error> {
        match *range {}
    }
    fn flush(&self) -> Result<(), Error> {
        match *self {}
    }
    fn set_mr_rights(&self, _mr: &mut VerbsMr, _access: Access, _domain: u32) -> Result<(), Error> {
        match *self {}
    }
    #[allow(unsafe_code)]
    unsafe fn reg_mr_iova(
        &self,
        _addr: u64,
        _len: u64,
        _access: Access,
        range: &NoRange,
        _domain: u32,
    ) -> Result<VerbsMr, Error> {
        match *range {}
    }
    fn set_resident(&self, _addr: u64, _len: u64, _resident: bool) -> Result<(), Error> {
        match *self {}
    }
}
