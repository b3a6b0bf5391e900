// Layout probe for the IBGDA headers: prints every size, offset and constant the Python twins define,
// then builds the WQEs described on stdin (one per line) with the header's builders and writes their
// 64-byte images to the file named by argv[1]. Compiled by tests/ibgda/test_layout.py with g++ and with
// nvcc (host code), which must agree byte for byte.
//
// Input lines:  kind index qpn fm_ce_se raddr rkey laddr lkey bytes value
//   kind: write | inline8 | read | fadd | nop     (value: the inline value or the fetch-add addend)
#include <stdio.h>
#include <string.h>

#include <transportd/ibgda/ibgda.cuh>

using namespace tpd::ibgda;

#define SIZE(T) printf("sizeof.%s %zu\n", #T, sizeof(T))
#define OFF(T, f) printf("offset.%s.%s %zu\n", #T, #f, offsetof(T, f))
#define CONST(name, v) printf("const.%s %llu\n", name, (unsigned long long)(v))

int main(int argc, char** argv) {
    SIZE(CtrlSeg); OFF(CtrlSeg, opmod_idx_opcode_be); OFF(CtrlSeg, qpn_ds_be); OFF(CtrlSeg, signature);
    OFF(CtrlSeg, stream_id_be); OFF(CtrlSeg, fm_ce_se); OFF(CtrlSeg, imm_be);
    SIZE(RaddrSeg); OFF(RaddrSeg, raddr_be); OFF(RaddrSeg, rkey_be); OFF(RaddrSeg, reserved);
    SIZE(DataSeg); OFF(DataSeg, byte_count_be); OFF(DataSeg, lkey_be); OFF(DataSeg, addr_be);
    SIZE(AtomicSeg); OFF(AtomicSeg, swap_add_be); OFF(AtomicSeg, compare_be);
    SIZE(InlineSeg8); OFF(InlineSeg8, byte_count_be); OFF(InlineSeg8, data);
    SIZE(Wqe);
    SIZE(Cqe64); OFF(Cqe64, srqn_uidx_be); OFF(Cqe64, imm_inval_pkey_be); OFF(Cqe64, app); OFF(Cqe64, app_op);
    OFF(Cqe64, app_info_be); OFF(Cqe64, byte_cnt_be); OFF(Cqe64, timestamp_be); OFF(Cqe64, sop_drop_qpn_be);
    OFF(Cqe64, wqe_counter_be); OFF(Cqe64, signature); OFF(Cqe64, op_own);
    SIZE(ErrCqe64); OFF(ErrCqe64, srqn_be); OFF(ErrCqe64, vendor_err_synd); OFF(ErrCqe64, syndrome);
    OFF(ErrCqe64, s_wqe_opcode_qpn_be); OFF(ErrCqe64, wqe_counter_be); OFF(ErrCqe64, signature);
    OFF(ErrCqe64, op_own);
    SIZE(QpState); OFF(QpState, claimed); OFF(QpState, posted); OFF(QpState, signaled); OFF(QpState, fence_next);
    OFF(QpState, rings);
    OFF(QpState, done); OFF(QpState, cq_ci); OFF(QpState, cq_lock); OFF(QpState, error);
    SIZE(QueuePair); OFF(QueuePair, sq); OFF(QueuePair, dbrec); OFF(QueuePair, bf); OFF(QueuePair, cq);
    OFF(QueuePair, cq_dbrec); OFF(QueuePair, state); OFF(QueuePair, scratch); OFF(QueuePair, qpn);
    OFF(QueuePair, wqe_cnt); OFF(QueuePair, ncqes); OFF(QueuePair, scratch_lkey);
    SIZE(Region); OFF(Region, addr); OFF(Region, length); OFF(Region, key); OFF(Region, reserved);
    using tpd::IbgdaChannel;
    SIZE(IbgdaChannel); OFF(IbgdaChannel, qps); OFF(IbgdaChannel, local); OFF(IbgdaChannel, remote);
    OFF(IbgdaChannel, remote_flags); OFF(IbgdaChannel, shadow); OFF(IbgdaChannel, flags); OFF(IbgdaChannel, error);
    OFF(IbgdaChannel, flag_count); OFF(IbgdaChannel, rank); OFF(IbgdaChannel, world); OFF(IbgdaChannel, nregions);
    OFF(IbgdaChannel, signal_mode); OFF(IbgdaChannel, abi);

    CONST("CTRL_FENCE", kCtrlFence); CONST("CTRL_SMALL_FENCE", kCtrlSmallFence);
    CONST("CTRL_CQ_UPDATE", kCtrlCqUpdate); CONST("CTRL_SOLICITED", kCtrlSolicited);
    CONST("WQE_BB", kWqeBasicBlock); CONST("INLINE_SEG", kInlineSeg); CONST("SND_DBR", kSendDbr);
    CONST("CQ_SET_CI", kCqSetCi); CONST("CQE_INITIAL_OP_OWN", kCqeInitialOpOwn); CONST("ABI", TPD_IBGDA_ABI);
    CONST("op.NOP", Mlx5Opcode::Nop); CONST("op.RDMA_WRITE", Mlx5Opcode::RdmaWrite);
    CONST("op.RDMA_READ", Mlx5Opcode::RdmaRead); CONST("op.ATOMIC_FA", Mlx5Opcode::AtomicFetchAdd);
    CONST("op.ATOMIC_CS", Mlx5Opcode::AtomicCompareSwap);
    CONST("cqe.REQ", CqeOpcode::Req); CONST("cqe.REQ_ERR", CqeOpcode::ReqErr); CONST("cqe.INVALID", CqeOpcode::Invalid);
    CONST("syn.LOCAL_LENGTH_ERR", Syndrome::LocalLengthErr); CONST("syn.LOCAL_QP_OP_ERR", Syndrome::LocalQpOpErr);
    CONST("syn.LOCAL_PROT_ERR", Syndrome::LocalProtErr); CONST("syn.WR_FLUSH_ERR", Syndrome::WrFlushErr);
    CONST("syn.REMOTE_ACCESS_ERR", Syndrome::RemoteAccessErr);
    CONST("mode.WRITE", SignalMode::Write); CONST("mode.ATOMIC", SignalMode::Atomic);
    CONST("mode.FENCE", SignalMode::Fence);

    if (argc < 2) return 0;
    FILE* out = fopen(argv[1], "wb");
    if (!out) return 2;
    char kind[16];
    unsigned long long index, qpn, fm, raddr, rkey, laddr, lkey, bytes, value;
    while (scanf("%15s %llu %llu %llu %llu %llu %llu %llu %llu %llu", kind, &index, &qpn, &fm, &raddr, &rkey, &laddr,
                 &lkey, &bytes, &value) == 10) {
        Wqe w;
        if (!strcmp(kind, "write"))
            w = rdma_write(index, (uint32_t)qpn, (uint8_t)fm, raddr, (uint32_t)rkey, laddr, (uint32_t)lkey,
                           (uint32_t)bytes);
        else if (!strcmp(kind, "inline8"))
            w = rdma_write_inline8(index, (uint32_t)qpn, (uint8_t)fm, raddr, (uint32_t)rkey, value);
        else if (!strcmp(kind, "read"))
            w = rdma_read(index, (uint32_t)qpn, (uint8_t)fm, raddr, (uint32_t)rkey, laddr, (uint32_t)lkey,
                          (uint32_t)bytes);
        else if (!strcmp(kind, "fadd"))
            w = atomic_fetch_add(index, (uint32_t)qpn, (uint8_t)fm, raddr, (uint32_t)rkey, value, laddr,
                                 (uint32_t)lkey);
        else if (!strcmp(kind, "nop"))
            w = nop(index, (uint32_t)qpn, (uint8_t)fm);
        else
            return 3;
        uint64_t word = doorbell_word(w);
        uint32_t dbrec = sq_dbrec_value(index + 1);
        fwrite(&w, sizeof w, 1, out);
        fwrite(&word, sizeof word, 1, out);    // the doorbell this WQE would be rung with
        fwrite(&dbrec, sizeof dbrec, 1, out);  // the doorbell record after it (send counter index + 1)
        uint32_t pad = 0;
        fwrite(&pad, sizeof pad, 1, out);
    }
    fclose(out);
    return 0;
}
