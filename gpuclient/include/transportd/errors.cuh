/*
 * transportd device API: the error codes a proxy writes into a channel's error word (tpd::ErrorCode,
 * TPD_ERR_*). The enum itself is the contract's generated <transportd/errors.h> (cmd_ring/include, on the
 * include path beside this root: gpuclient.get_include_dirs()); this header keeps the device API's name.
 */
#ifndef TRANSPORTD_ERRORS_CUH
#define TRANSPORTD_ERRORS_CUH

#include <transportd/errors.h>

#endif /* TRANSPORTD_ERRORS_CUH */
