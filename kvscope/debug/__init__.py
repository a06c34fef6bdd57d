"""The memory debugger: the slot-ownership ledger, the live monitor, leak reports and checks."""
