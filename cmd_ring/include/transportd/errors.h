/*
 * transportd error codes: what a proxy writes into a channel's error word, and what the C core returns
 * for a bad record. Plain C99 that also compiles as C++/CUDA (NVRTC included); part of the contract both
 * sides share (cmd_ring/include), so the daemon's core and the device API use this one enum.
 *
 * ABI: these mirror ErrorCode (cmd_ring/errors.py, re-exported as transportd.errors.ErrorCode) value for
 * value; the block between the markers is the output of error_code_c_enum() and a test fails if the two
 * ever differ. A kernel reads the first bad record's code with tpd::status(ch) (0 = every record so far was
 * accepted).
 */
#ifndef TRANSPORTD_ERRORS_H
#define TRANSPORTD_ERRORS_H

/* BEGIN error_code_c_enum() */
enum tpd_error_code {
    /** No error: every record on this channel so far was accepted. */
    TPD_ERR_OK = 0,
    /** A record's opcode is not one the proxy knows; the record was not posted. */
    TPD_ERR_BAD_OPCODE = 1,
    /** A record names a destination rank outside the job's world or without a connection. */
    TPD_ERR_BAD_PEER = 2,
    /** A record names a region id not registered by this job (regions are job-scoped). */
    TPD_ERR_BAD_REGION = 3,
    /** offset + length falls outside the source or destination region. */
    TPD_ERR_OUT_OF_BOUNDS = 4,
    /** A transfer length of zero, or above the backend's maximum message size. */
    TPD_ERR_BAD_LENGTH = 5,
    /** A signal or flag slot index outside the channel's flag array. */
    TPD_ERR_BAD_SLOT = 6,
    /** The session is over (left, reclaimed, or the daemon stopped): its records are refused. */
    TPD_ERR_CLIENT_GONE = 7,
    /** The destination's node stopped answering heartbeats; its work was flushed. */
    TPD_ERR_PEER_LOST = 8,
    /** The remote NIC refused the access (rkey, bounds or permission): a remote-access error. */
    TPD_ERR_REMOTE_ACCESS = 9,
    /** Any other completion error from the NIC (retry exceeded, QP in error, flush). */
    TPD_ERR_TRANSPORT = 10,
    /** An atomic signal's address or a flag's address is not 8-byte aligned. */
    TPD_ERR_BAD_ALIGNMENT = 11,
    /** A torn or corrupt record (commit word or parity mismatch); it was skipped. */
    TPD_ERR_BAD_RECORD = 12,
    /** The region was registered without the access the operation needs (read/write/atomic). */
    TPD_ERR_NO_ACCESS = 13,
    /** A daemon restart or crash (its own, or the destination's) came between the post and the completion: the record may or may not have executed; the error position is the first such record. */
    TPD_ERR_UNKNOWN_OUTCOME = 14,
    /** The channel did not survive a daemon restart (an IBGDA channel: its queue pairs and keys died with the daemon); open a new one, the session is still valid. */
    TPD_ERR_CHANNEL_LOST = 15,
    /** A fault inside the daemon itself; the daemon's log has the details. */
    TPD_ERR_INTERNAL = 255,
};
/* END error_code_c_enum() */

#if defined(__cplusplus)
namespace tpd {
using ErrorCode = ::tpd_error_code;
}  // namespace tpd
#endif

#endif /* TRANSPORTD_ERRORS_H */
