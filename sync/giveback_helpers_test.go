package sync

// heldGiveBacks returns how many give-backs g holds: queued, on the wire, or waiting for
// their second round.
func heldGiveBacks(g *Global) int {
	q := &g.giveBacks
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.held
}
