package sync

// Slots is the number of hash slots of a Redis Cluster.
const Slots = 16384

// Slot returns the Redis Cluster hash slot of key: CRC16 (CCITT, XMODEM) of its hash tag
// mod 16384. The hash tag is what lies between the first '{' and the first '}' after it,
// when that is non-empty; otherwise the whole key is hashed. Keys with the same hash tag
// share a slot, so a script may touch them together on a cluster.
//
// For example Slot("foo") is 12182, and "{user1000}.following" and "{user1000}.followers"
// share slot 3443.
func Slot(key string) uint16 {
	if i := indexByte(key, '{'); i >= 0 {
		if j := indexByte(key[i+1:], '}'); j > 0 {
			key = key[i+1 : i+1+j]
		}
	}
	var crc uint16
	for k := 0; k < len(key); k++ {
		crc = crc<<8 ^ crc16tab[byte(crc>>8)^key[k]]
	}
	return crc % Slots
}

func indexByte(s string, c byte) int {
	for i := 0; i < len(s); i++ {
		if s[i] == c {
			return i
		}
	}
	return -1
}

// crc16tab is the table of CRC16-CCITT (XMODEM: polynomial 0x1021, initial value 0), as
// in Redis's crc16.c.
var crc16tab = func() (t [256]uint16) {
	for i := range t {
		c := uint16(i) << 8
		for range 8 {
			if c&0x8000 != 0 {
				c = c<<1 ^ 0x1021
			} else {
				c <<= 1
			}
		}
		t[i] = c
	}
	return t
}()
